"""Running a workload: runner, workload files, run options, faults and test hooks, process settings."""
