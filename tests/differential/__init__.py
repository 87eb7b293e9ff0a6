"""The differential tester: a seeded generator of examples (space.py), the fits each needs (plan.py), their runs
in few multi-rank launches (runner.py, tests/scripts/differential_fit.py), the comparison with the references
(compare.py) and the shrinking of a failure to its smallest configuration (shrink.py). docs/composition.md ("The
differential tester") describes the space, the references and tolerances, the refusals and how to run it:
``python -m tests.differential --examples N --world W --seed S``."""
