from planner_factories import counted, llama70b, measured_cost  # noqa: F401  (fixtures)
