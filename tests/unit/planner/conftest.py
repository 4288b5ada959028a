from planner_factories import llama70b, measured_cost  # noqa: F401  (fixtures)
