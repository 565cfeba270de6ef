"""The run's control: the Supervisor actor, its controller and step, and the pure decisions they take."""
