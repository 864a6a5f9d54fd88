"""Loading: targets and options, the pure planner, the budgeted executor, the engine, streaming, assembly, the report."""
