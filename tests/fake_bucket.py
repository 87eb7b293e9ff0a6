import torch


class FakeBucket:
    """What DDP's GradBucket offers a comm hook: a flat buffer (0, 1, 2, ...) and the parameters' views into it."""

    def __init__(self, params: list[torch.Tensor], last: bool = True) -> None:
        self._params, self._last = params, last
        self._buffer = torch.arange(float(sum(p.numel() for p in params)))
        self._grads, offset = [], 0
        for p in params:
            self._grads.append(self._buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads

    def is_last(self):
        return self._last
