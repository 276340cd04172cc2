"""Train an agent on WebShop (offline, text mode) with ORSD, GRPO, GiGPO or an ORSD ablation.

python -m experiments.train_webshop                                  # cpu-demo: the embedded model, warm-started
python -m experiments.train_webshop --preset tiny --data-dir PATH   # official 1000-product files
python -m experiments.train_webshop --preset paper-qwen3-4b --dry-run

The data directory defaults to $WEBSHOP_DATA, else ../shared/webshop beside the checkout.
"""

from experiments import common


def main(argv: list[str] | None = None) -> None:
    common.main("webshop", __doc__, argv)


if __name__ == "__main__":
    main()
