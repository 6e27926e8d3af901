"""The transport interface (`Queue`), the HTTP API's table and the workers' HTTPS client:
what a rollout worker anywhere runs. Nothing here imports a Redis client or the
trusted side's modules (a contract `make lint` checks)."""
