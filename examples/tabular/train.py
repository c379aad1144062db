"""The same task started from a script of your own instead of `-m trainapp` (docs/your-own-model.md):

    PYTHONPATH=examples/tabular torchrun --standalone --nproc_per_node=2 examples/tabular/train.py \
        --config examples/tabular/config.yaml train.max_steps=200

Arguments are trainapp's (`--config FILE`, `KEY=VALUE` overrides); so are the errors and exit codes.
"""

from tabular_task import Regression

import trainapp

if __name__ == "__main__":
    trainapp.main(Regression(hidden=64))
