"""Commands that read checkpoints and logs (export, verify, inspect, plan, status, plot); no control."""
