"""The background services beat runs: lane delivery, history, periodic schedules,
heartbeats, the consistency check."""
