"""Fault injection at named points, process kills by id, and a multi-node Ray cluster on one machine
(for the tests and `relaunch demo`)."""
