"""relaunch: keeps distributed RL post-training running through failures."""
