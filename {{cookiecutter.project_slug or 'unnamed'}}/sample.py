"""Continue a prompt with a trained language model: the model of a checkpoint or of model.pt.

    python sample.py runs/<run>                        # the run's result (as evaluate.py takes it)
    python sample.py runs/<run>/model.pt --prompt "The " --tokens 200 --temperature 0.8 \\
        --top-k 40 --seed 1 --samples 3
    python sample.py path/to/hf-model                  # a causal LM saved by save_pretrained

One process, on the first GPU if there is one, else the CPU. The model and its data come from the
checkpoint's config: the token folder (data.root, data.dataset=tokens) gives the vocabulary that
encodes the prompt and decodes the continuation, and data.block_size the context the model
sees. Any model that returns the logits of every position works (model.name=gpt, or yours: a
tensor, a (logits, loss) pair or a Hugging Face causal-LM output). A folder written by a Hugging
Face model's save_pretrained (config.json) is loaded with its tokenizer, saved to the same
folder (the transformers extra). The same seed writes the same text. Each continuation is
printed whole, prompt first, followed by a line of dashes. Which weights (docs/checkpoints.md,
"Which weights"): a run that kept averaged weights (train.ema_decay) samples from its averages;
`--weights trained` takes the trained ones. One line on stderr says which (stdout is the text).
"""

import argparse
import math
import sys
from pathlib import Path

import torch

from ddpkit import checkpoint_files, checkpoint_load, lifecycle, recipes, weight_choice
from ddpkit.config import UserError, config_from_dict
from ddpkit.data import build_splits
from ddpkit.evaluation import run_folder_choice
from ddpkit.lm import generate, logits_of
from ddpkit.parallel import build_model
from ddpkit.tasks import build_task
from ddpkit.tokens import Vocabulary


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python sample.py", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="a run folder, a checkpoint folder, a model.pt or a "
                        "Hugging Face model's folder")
    parser.add_argument("--prompt", default="\n", help="the text to continue (default: a "
                        "new line)")
    parser.add_argument("--tokens", type=whole("--tokens", 1), default=200,
                        help="tokens to add (default 200)")
    parser.add_argument("--temperature", type=temperature, default=0.8,
                        help="below 1: likelier tokens; 0: always the likeliest (default 0.8)")
    parser.add_argument("--top-k", type=whole("--top-k", 0), default=0,
                        help="draw from the k likeliest tokens only; 0: all (default)")
    parser.add_argument("--seed", type=whole("--seed", 0, 2**64 - 1), default=0)
    parser.add_argument("--samples", type=whole("--samples", 1), default=1,
                        help="continuations (default 1)")
    parser.add_argument("--weights", default="auto", choices=weight_choice.CHOICES,
                        help="auto (default): the averaged weights where the run kept them, "
                        "else the trained ones")
    return parser.parse_args(argv)


def whole(option: str, least: int, most: int | None = None):
    """An argument type: a whole number from `least` to `most`, else one line (a UserError
    passes through argparse)."""
    wanted = f"from {least} to {most}" if most is not None else f"{least} or more"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least or (most is not None and value > most):
            raise UserError(f"{option} {text}: give a whole number, {wanted}")
        return value

    return parse


def temperature(text: str) -> float:
    """--temperature: a finite number, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise UserError(f"--temperature {text}: give a finite number, 0 or more (0: always the "
                        "likeliest token)")
    return value


def load(spec: str, weights: str = "auto"):
    """The model of a run folder, checkpoint or model file (with the weights asked for, said on
    stderr), with its vocabulary and context."""
    path = Path(spec)
    if (path / "config.json").is_file():  # a Hugging Face model's own folder
        return load_pretrained(path)
    chosen = run_folder_choice(path)[0] if (path / "checkpoints").is_dir() else path
    source = checkpoint_files.find_checkpoint(str(chosen))
    state = checkpoint_load.load_checkpoint(source)
    which = weight_choice.choose(source, state, weights, f"--weights {weights}")
    cfg = config_from_dict(state.get("config", {}), f"config stored in {source}")
    splits = build_splits(cfg)
    meta = getattr(splits.train, "meta", None)
    if meta is None:
        raise UserError(f"{source} was trained on data.dataset={cfg.data.dataset}, not on token "
                        "data (data.dataset=tokens): sample.py writes text for language models")
    task = build_task(cfg, splits)
    input_shape = task.input_shape(splits.val[0])
    model = build_model(cfg.model, input_shape, task.num_outputs)
    checkpoint_load.load_model_weights(model, source, weight_choice.read(source, state, which))
    vocabulary = Vocabulary(meta)
    print(f"sampling {weight_choice.describe(which, source, state.get('step'))}",
          file=sys.stderr, flush=True)
    return model.eval(), vocabulary, input_shape[0]


def load_pretrained(folder: Path):
    """A causal LM saved by save_pretrained, its tokenizer in the same folder (nothing is
    downloaded); its context: the positions it was built for."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise UserError(f"{folder} is a Hugging Face model's folder: reading it needs the "
                        "transformers extra (pip install -e '.[transformers]')") from None
    if not (folder / "tokenizer_config.json").is_file():
        raise UserError(f"{folder} holds a model but no tokenizer: save the model's tokenizer "
                        "to the same folder (tokenizer.save_pretrained)")
    model = AutoModelForCausalLM.from_pretrained(folder)
    context = getattr(model.config, "max_position_embeddings", None) or sys.maxsize
    return model.eval(), Vocabulary({"tokenizer": str(folder)}), context


def check_vocabulary(model: torch.nn.Module, prompt: torch.Tensor, context: int,
                     vocabulary: Vocabulary, source: str) -> None:
    """A model that predicts more token ids than its vocabulary decodes (the model's output
    size above the vocabulary's) is one line, before any text is drawn."""
    with torch.no_grad():
        outputs = logits_of(model(prompt[:, -context:])).shape[-1]
    if outputs > vocabulary.size:
        raise UserError(f"the model of {source} predicts {outputs} token ids, and its vocabulary "
                        f"decodes {vocabulary.size}: sample with the token data (data.root) or "
                        "the tokenizer it was trained with")


def main(argv: list[str]) -> None:
    args = arguments(argv)
    recipes.load()  # your model.py, data_sources.py and tasks.py add to the registries
    model, vocabulary, context = load(args.source, args.weights)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    prompt = torch.tensor([vocabulary.encode(args.prompt)], device=device)
    if prompt.numel() == 0:
        raise UserError("--prompt encodes to no tokens: give it some text")
    check_vocabulary(model, prompt, context, vocabulary, args.source)
    generator = torch.Generator(device).manual_seed(args.seed)
    for _ in range(args.samples):
        tokens = generate(model, prompt, args.tokens, context, args.temperature, args.top_k,
                          generator)
        print(vocabulary.decode(tokens[0].tolist()), "-" * 40, sep="\n", flush=True)


if __name__ == "__main__":
    lifecycle.run_main(main, one_shot=True)
