"""Optional methods, each a folder the step never names: ``first_mistake`` (token advantages from a teacher's
first-mistake judgment) and ``l2rr`` (a learned prompt sampler scored against a target). The run's builder wires
each one in from its config section."""
