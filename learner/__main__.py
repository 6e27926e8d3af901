"""`python -m learner ...` (and `torchrun ... -m learner run ...`): the `learner` command."""

import sys

from learner.cli import main

sys.exit(main())
