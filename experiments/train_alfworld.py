"""Train an agent on ALFWorld with ORSD, GRPO, GiGPO or an ORSD ablation.

python -m experiments.train_alfworld                         # cpu-demo: the embedded model, ORSD
python -m experiments.train_alfworld --method grpo --out runs/grpo
python -m experiments.train_alfworld --preset paper-qwen3-1.7b --dry-run
python -m experiments.train_alfworld --out runs/x --resume    # continue a killed run
"""

from experiments import common


def main(argv: list[str] | None = None) -> None:
    common.main("alfworld", __doc__, argv)


if __name__ == "__main__":
    main()
