"""A peer's side of an epoch: running its stage, re-laying stages out, fetching and serving
them (protocol: docs/control.md).

    runner.py    StageRunner: one stage's training loop in a worker thread
    relayout.py  assembling a stage from old stages (re-splitting layers)
    recovery.py  fetching a stage from its holders, and serving ours
"""
