"""The worker groups on Ray: placement, spawning, calls with timeouts, removal; warm spares."""
