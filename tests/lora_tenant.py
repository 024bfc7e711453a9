"""A tenant of tests/test_lora.py, as its own client process:

    python -m tests.lora_tenant ADDRESS TOKEN_FILE BASE

Attaches an adapter (named "tenant") to the resident base BASE, prints "training" once its first
step is done, then keeps steps queued until it is killed."""

import sys

import atoll
from tests import lora_cases, models


def main() -> None:
    address, token_file, base = sys.argv[1:]
    import transformers

    model, batches = lora_cases.base_model(transformers)
    x, y = batches[0]
    with atoll.connect(address, token_file=token_file) as client:
        job = client.lora(
            model, base=base, name="tenant", example_input=x, example_target=y, loss_fn=models.lm_loss,
            microbatches=lora_cases.MICROBATCHES, schedule="1f1b", **lora_cases.ADAPTERS[3],
        )  # fmt: skip
        job.step(x, y)
        print("training", flush=True)
        while True:
            futures = [job.step_async(bx, by) for bx, by in batches]
            for f in futures:
                f.result()


if __name__ == "__main__":
    main()
