"""Small utilities every command uses: logging, the lifeline, the preflight runner,
retries with backoff, paths and the model fingerprint."""
