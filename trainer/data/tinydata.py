"""Generate the small offline corpus and BPE tokenizer used by the demo, the tests and CI.

    python -m trainer.data.tinydata OUT_DIR [--docs N]

Writes two sources in different formats so mixing and every reader are exercised:
  OUT_DIR/stories/part-0000{0..3}.jsonl    short templated stories (learnable structure)
  OUT_DIR/facts/part-0000{0,1}.parquet     arithmetic and comparison facts
  OUT_DIR/tokenizer.json                   byte-level BPE, 512 tokens, trained on both
  OUT_DIR/prepared/{stories,facts}/        both tokenized into token shards (trainer.data.prepare)
The text is produced from a seeded grammar, so every machine generates identical files.
"""

from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Esme", "Finn", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena"]
ANIMALS = ["cat", "dog", "fox", "owl", "bear", "frog", "mouse", "horse"]
PLACES = ["forest", "river", "garden", "market", "hill", "village", "lake", "barn"]
OBJECTS = ["red ball", "old map", "blue kite", "small box", "green hat", "shiny key", "wooden boat"]
FEELINGS = ["happy", "tired", "curious", "brave", "quiet", "hungry"]
VERBS = ["found", "lost", "carried", "painted", "hid", "shared"]


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal, place, obj = rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(OBJECTS)
    feeling, verb = rng.choice(FEELINGS), rng.choice(VERBS)
    lines = [
        f"Once upon a time, {name} lived near the {place} with a {animal}.",
        f"One day {name} {verb} a {obj} by the {place}.",
        f"The {animal} was {feeling}, so {name} called {friend}.",
        f"{friend} came to the {place} and looked at the {obj}.",
        f"Together they took the {obj} home, and the {animal} was {rng.choice(FEELINGS)} again.",
    ]
    return " ".join(lines[: rng.randint(3, 5)]) + " The end."


def fact(rng: random.Random) -> str:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    kind = rng.randint(0, 2)
    if kind == 0:
        return f"{a} plus {b} is {a + b}."
    if kind == 1:
        big, small = max(a, b), min(a, b)
        return f"{big} minus {small} is {big - small}."
    rel = "greater than" if a > b else "less than" if a < b else "equal to"
    return f"{a} is {rel} {b}."


def generate(out: str, docs: int = 4000, seed: int = 0) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    os.makedirs(f"{out}/stories", exist_ok=True)
    os.makedirs(f"{out}/facts", exist_ok=True)
    stories = [story(rng) for _ in range(docs)]
    facts = [" ".join(fact(rng) for _ in range(rng.randint(4, 12))) for _ in range(docs // 2)]
    for part in range(4):
        with open(f"{out}/stories/part-{part:05d}.jsonl", "w") as fh:
            for text in stories[part::4]:
                fh.write(json.dumps({"text": text}) + "\n")
    for part in range(2):
        pq.write_table(pa.table({"text": facts[part::2]}), f"{out}/facts/part-{part:05d}.parquet")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(stories + facts, trainer=trainer)
    tok.save(f"{out}/tokenizer.json")
    return {"stories": f"{out}/stories", "facts": f"{out}/facts", "tokenizer": f"{out}/tokenizer.json"}


def paths(out: str) -> dict[str, str]:
    """The corpus's raw sources, the tokenizer, and the same sources prepared (trainer.data.prepare)."""
    return {"stories": f"{out}/stories", "facts": f"{out}/facts", "tokenizer": f"{out}/tokenizer.json",
            "stories_prepared": f"{out}/prepared/stories", "facts_prepared": f"{out}/prepared/facts"}


def ensure(out: str) -> dict[str, str]:
    """Generate into OUT once, and prepare its token shards once; later calls reuse the files.
    Each is made in a private directory and renamed into place: concurrent callers never see
    a half-written one."""
    import shutil

    if not os.path.exists(f"{out}/tokenizer.json"):
        tmp = f"{out}.tmp{os.getpid()}"
        generate(tmp)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    found = paths(out)
    if not os.path.exists(f"{out}/prepared"):
        tmp = f"{out}/prepared.tmp{os.getpid()}"
        prepare(found, tmp)
        try:
            os.rename(tmp, f"{out}/prepared")
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return found


def prepare(found: dict[str, str], dest: str) -> None:
    """Both sources' token shards under DEST (what python -m trainer.data.prepare makes)."""
    from ..config import DataConfig
    from .prepare import Preparer

    defaults = DataConfig()
    for name in ("stories", "facts"):
        prep = Preparer(found[name], found["tokenizer"], f"{dest}/{name}", defaults.eos_token, defaults.text_field)
        prep.claim_directory()
        for k in range(len(prep.shards)):
            prep.prepare_shard(k)
        if prep.finish():
            raise RuntimeError(f"preparing {found[name]} left shards incomplete")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--docs", type=int, default=4000)
    args = ap.parse_args()
    generate(args.out, args.docs)
    found = paths(args.out)
    prepare(found, f"{args.out}/prepared")
    print(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
