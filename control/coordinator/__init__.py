"""The coordinator's side of the control plane (protocol: docs/control.md).

    machine.py   Coordinator: hand-out, step log, reconfiguration, sans-IO (events in, actions out)
    steplog.py   StepLog: the epoch it handed out, its step reports and the log lines they complete
    schedule.py  the scheduler's placement on the gossiped view
    reshape.py   the re-allocation planner
    request.py   what `train start` asks for
    leftout.py   LeftOut: peers that refused an allocation, left out of the next attempts for a back-off
"""
