"""What the user chooses for gradient synchronization, validated where it is given.

Every bad value raises ``ValueError`` naming the parameter, the value and what is allowed, at construction
(``HorizonStrategy(...)`` runs this in the Trainer's constructor, before any process starts). The one check
that needs the world size (``torus_shape``) runs at setup, in :meth:`CollectivesConfig.grid_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from lightning_horizon.checks import check_int, check_one_of, is_int, is_number, require
from lightning_horizon.collectives.outer import OUTERS

_OWNER = "HorizonStrategy"  # the strategy's arguments of the same names reach this config

ALGORITHMS = ("flat", "hierarchical", "torus2d", "auto")
OUTER_OPTIONS = ("outer", "outer_lr", "outer_momentum", "sync_overlap")  # the periodic sync's, sync_every > 1 only
COMPRESSIONS = (None, "bf16", "int8")


@dataclass(frozen=True)
class CollectivesConfig:
    """How DDP's gradient buckets are reduced (see docs/collectives.md)."""

    collectives: str = "flat"
    """``"flat"``: one allreduce over the world (DDP's own behaviour, overlapped with backward).
    ``"hierarchical"``: reduce-scatter inside the node, allreduce of each 1/L slice across nodes by every local
    rank in parallel, all-gather inside the node. ``"torus2d"``: the same three stages on an X x Y grid
    (rows of X consecutive ranks, X = ranks per node unless ``torus_shape`` says otherwise).
    ``"auto"``: per bucket size, the cheapest of these by the alpha-beta cost model."""

    compression: Optional[str] = None
    """``None``, ``"bf16"`` or ``"int8"`` (a scale per ``int8_block`` elements). Applies to the inter-node stage
    (the whole allreduce with ``flat``); values are summed in fp32 after an all-to-all, never in the narrow type,
    and the rounding error is fed back into the next step (error feedback)."""

    sync_every: int = 1
    """1: every step reduces gradients across the world. k > 1: hierarchical local SGD, gradients are reduced
    inside the node every step and parameters are averaged across nodes every k optimizer steps."""

    sync_warmup_steps: int = 0
    """With ``sync_every > 1``: the first optimizer steps that still reduce gradients across the world
    (post-local SGD warm-up). Counted in the checkpoint, so a resume does not start the warm-up again."""

    outer: str = "average"
    """With ``sync_every > 1``, what a sync does with the nodes' weights. ``"average"``: their average (local SGD).
    ``"nesterov"``: DiLoCo's outer step, SGD with Nesterov momentum on the average change of the period, from the
    weights of the last sync (``outer_lr``, ``outer_momentum``)."""

    outer_lr: float = 0.7
    """With ``outer="nesterov"``: the outer learning rate (DiLoCo's 0.7)."""

    outer_momentum: float = 0.9
    """With ``outer="nesterov"``: the outer momentum (DiLoCo's 0.9), in [0, 1)."""

    sync_overlap: Union[bool, str] = False
    """With ``sync_every > 1``: ``True``: the cross-node exchange runs behind the next period's steps instead of
    blocking, and its outer update is applied one period late, on top of what each node trained meanwhile.
    ``"auto"``: that staleness is allowed, and taken where the cost model predicts it saves time (decided at the
    first sync, logged, checkpointed)."""

    torus_shape: Optional[tuple[int, int]] = None
    """``(X, Y)`` for ``torus2d``: X ranks per row (consecutive ranks), Y rows, X * Y = world size. ``None``:
    X = ranks per node, so rows are nodes and columns cross nodes."""

    cost_model: Optional[Any] = None
    """Link constants for ``auto`` instead of the setup probe: a ``CostModel`` or
    ``{"intra": (alpha_s, beta_s_per_byte), "inter": (alpha_s, beta_s_per_byte)}``, with an optional
    ``"codec": {"bf16": s_per_element, "int8": s_per_element}`` (the codecs' CPU time; absent: none counted)."""

    int8_block: int = field(default=256, metadata={"keyword": False})
    """Elements per int8 scale: smaller blocks follow the gradient's range more closely, at 4 bytes per block."""

    pipeline_chunk_mb: float = field(default=2.0, metadata={"keyword": False})
    """Two-level reductions cut a bucket into chunks of this many MiB and pipeline them: the intra-node stages
    of one chunk run while another crosses the nodes. Smaller chunks overlap more and pay more latency."""

    def changed(self) -> list[str]:
        """The options away from their defaults, as the strategy's arguments spell them (``"compression='int8'"``)."""
        default = CollectivesConfig()
        return [f"{f.name}={getattr(self, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]

    def __post_init__(self) -> None:
        check_one_of(_OWNER, "collectives", self.collectives, ALGORITHMS)
        check_one_of(_OWNER, "compression", self.compression, COMPRESSIONS)
        check_int(_OWNER, "sync_every", self.sync_every, 1)
        check_int(_OWNER, "sync_warmup_steps", self.sync_warmup_steps, 0)
        check_int("CollectivesConfig", "int8_block", self.int8_block, 1)
        require(is_number(self.pipeline_chunk_mb, 0), "CollectivesConfig", "pipeline_chunk_mb", self.pipeline_chunk_mb,
                "a finite number > 0 (MiB)")
        check_one_of(_OWNER, "outer", self.outer, OUTERS)
        require(is_number(self.outer_lr, 0), _OWNER, "outer_lr", self.outer_lr, "a finite number > 0")
        require(is_number(self.outer_momentum, 0, 1, include_low=True), _OWNER, "outer_momentum",
                self.outer_momentum, "a number in [0, 1)")
        require(isinstance(self.sync_overlap, bool) or self.sync_overlap == "auto", _OWNER, "sync_overlap",
                self.sync_overlap, "True, False or 'auto'")
        outer = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name in OUTER_OPTIONS
                 and getattr(self, f.name) != f.default]
        if outer and self.sync_every == 1:
            raise ValueError(f"{', '.join(outer)} with sync_every=1: options of the periodic cross-node sync; allowed"
                             " with sync_every > 1 (e.g. sync_every=4)")
        if self.sync_every > 1 and self.compression is not None:
            raise ValueError(
                f"compression={self.compression!r} with sync_every={self.sync_every}: compression applies to the"
                " inter-node gradient stage, which sync_every > 1 replaces by parameter averaging; allowed is"
                " compression=None with sync_every > 1"
            )
        if self.torus_shape is not None:
            shape = self.torus_shape
            if (
                not isinstance(shape, (tuple, list))
                or len(shape) != 2
                or not all(is_int(v, 1) for v in shape)
            ):
                raise ValueError(f"torus_shape={shape!r}: allowed is None or a pair (X, Y) of positive ints")
            if self.collectives not in ("torus2d", "auto"):
                raise ValueError(
                    f"torus_shape={tuple(shape)!r} with collectives={self.collectives!r}: torus_shape is used by"
                    " collectives='torus2d' or 'auto' only"
                )
            object.__setattr__(self, "torus_shape", tuple(shape))
        if self.cost_model is not None:
            from lightning_horizon.collectives.cost_model import CostModel

            object.__setattr__(self, "cost_model", CostModel.coerce(self.cost_model))

    def grid_shape(self, world_size: int, ranks_per_node: int) -> tuple[int, int]:
        """``(X, Y)`` of the torus for this world: ``torus_shape``, checked, or ``(ranks_per_node, nodes)``."""
        if self.torus_shape is None:
            return ranks_per_node, world_size // ranks_per_node
        x, y = self.torus_shape
        if x * y != world_size:
            pairs = [(d, world_size // d) for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"torus_shape={self.torus_shape!r}: X * Y = {x * y} does not match the world size {world_size};"
                f" allowed are {pairs}"
            )
        return x, y

    def check_world(self, world_size: int, ranks_per_node: int) -> None:
        """The torus grid fits the world (:meth:`grid_shape`) and, with compression, has a stage to compress."""
        x, y = self.grid_shape(world_size, ranks_per_node)
        if self.collectives == "torus2d" and self.compression is not None and y == 1 and x > ranks_per_node:
            # only the column stage is compressed; one row that spans nodes sends every byte across them uncompressed
            raise ValueError(f"{_OWNER}(collectives='torus2d', torus_shape={self.torus_shape!r}, compression="
                             f"{self.compression!r}): a grid of one row spanning {x // ranks_per_node} nodes has no"
                             " column stage, the only one compressed, so nothing would be; use a torus_shape with"
                             " Y > 1, or collectives='hierarchical'")

    @property
    def chunk_numel(self) -> int:
        """``pipeline_chunk_mb`` in fp32 elements."""
        return max(1, int(self.pipeline_chunk_mb * 2**20) // 4)
