"""The coordinator's side of the control plane: the scheduler's placement (schedule.py), the
re-allocation planner (reshape.py), the resume point (runstate.py) and what `train start` asks
for (request.py). The protocol is in docs/control.md."""
