"""The coordinator's side of the control plane (protocol: docs/control.md).

    machine.py         Coordinator: the core, sans-IO (events in, actions out); routes to its parts
    operator_queue.py  OperatorQueue: the operators' requests, their checks and the queue behind a procedure
    procedure.py       Procedures: the one start or reconfiguration in progress (its record: record.py)
    handout.py         HandOut: the run handed out, its phase, the hand-out, the step log kept
    watch.py           RunWatch: triggers, probes, the step deadline, cut links, failed steps, joins
    keys.py            the typed keys of the machine's requests (`ProcStep`, `ProbeKey`, ...)
    phase.py           Phase, CoordinatorStatus, and `run_word` / `run_over`: what the run is, decided once
    context.py         what every part reads (election, epoch machine, swarm, scheduler, timings, clock)
    allocate.py        building the next allocation, its council and holdings (pure)
    steplog.py         StepLog: the epoch it handed out, its step reports and the log lines they complete
    schedule.py        the scheduler's placement on the gossiped view
    reshape.py         the re-allocation planner
    request.py         what `train start` asks for
    leftout.py         LeftOut: peers that refused an allocation, left out of the next attempts for a back-off
"""
