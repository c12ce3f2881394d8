"""A peer's side of an epoch (protocol: docs/control.md).

    machine.py   EpochMachine: this peer's part in each epoch, sans-IO (events in, actions out)
    runstate.py  PeerRunState (what a peer holds) and resume_point
    report.py    StepReport and RunEnd: what the runner thread reports (no torch)
    runner.py    StageRunner: one stage's training loop in a worker thread
    relayout.py  assembling a stage from old stages (re-splitting layers)
    recovery.py  fetching a stage from its holders, and serving ours
"""
