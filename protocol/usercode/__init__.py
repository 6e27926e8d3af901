"""User code and what reads it: loading rewards, tools, environments and chat templates,
the episode transcript both tiers read, and the built-in tasks and rewards
(`protocol.usercode.tasks:next_digit`, `protocol.usercode.math_reward:accuracy`) that
the actors and the trusted scoring tier both run."""
