"""The trusted scoring tier (`learner score`): RQ workers on the run's Redis that score
groups with the prompts' private columns and replay environments in a sandbox. With
`protocol.trusted`, the only code that imports `redis` or `rq`."""
