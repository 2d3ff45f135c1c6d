"""A generated claim/evidence task about invented companies: `python -m data.synthetic --n 200 --seed 0 --out FILE`.

Each example shows 3-4 sentences, each stating one attribute of an invented company, and a claim about one
company's attribute: SUPPORTS when a sentence states it with the same value, REFUTES with another value,
NOT_ENOUGH_INFO when none states it; the deciding sentence is the gold evidence. Rows use the SciFact prompt
and reward, so the demo runs the real pipeline on facts no model knows."""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from data.jsonio import exit_on_bad_input
from data.rows import write_rows
from data.scifact import LABELS, evidence_row

FIRST_SYLLABLES = ("Zor", "Quen", "Brim", "Tal", "Vex", "Mor", "Kel", "Dra", "Pel", "Sor", "Ulm", "Fen", "Gar", "Hol",
                   "Nix", "Yar")
SECOND_SYLLABLES = ("vex", "ta", "well", "dor", "rin", "bek", "sto", "mar", "lin", "quay", "dith", "ora")
KINDS = ("Labs", "Foods", "Works", "Motors", "Textiles", "Mills", "Systems", "Studios")
CITIES = ("Tarnow", "Elsbridge", "Quarrow", "Mistvale", "Oldhaven", "Brackley", "Dunmore", "Fairmoss", "Corvale")
PRODUCTS = ("glass lenses", "wool blankets", "solar kettles", "paper kites", "brass bells", "clay bricks",
            "rope ladders", "tin whistles")
PEOPLE = ("Mara Voss", "Tomas Kell", "Ines Darrow", "Olek Brand", "Lena Ferris", "Paul Ostrin", "Rhea Malden")
COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")

# attribute: (context sentence, claim, value pool). Sentences run ~7-9 words; claims paraphrase them so the
# model has to match meaning rather than copy a string, while the evidence it copies is the context sentence.
ATTRIBUTES = {
    "founded": ("{entity} was founded in the year {value}.", "{entity} was founded in {value}.",
                [str(year) for year in range(1950, 2021)]),
    "city": ("The head office of {entity} is in {value}.", "{entity} is based in {value}.", CITIES),
    "staff": ("{entity} employs about {value} people in total.", "{entity} has about {value} employees.",
              [str(n) for n in range(50, 1000, 10)]),
    "product": ("{entity} is best known for making {value}.", "{entity} makes {value}.", PRODUCTS),
    "leader": ("{entity} is currently led by {value}.", "{entity} is run by {value}.", PEOPLE),
    "colour": ("The logo of {entity} is bright {value}.", "The logo of {entity} is {value}.", COLOURS),
}
TITLE = "Company records"


def _sentence(attribute: str, entity: str, value: str) -> str:
    return ATTRIBUTES[attribute][0].format(entity=entity, value=value)


def generate_example(rng: random.Random, label: str) -> tuple[str, list[str], list[int]]:
    """(claim, context sentences, gold evidence indices) for one example with the given label."""
    num_sentences = rng.randint(3, 4)  # 5 would push the chat-rendered prompt past ~200 tokens
    names: set[str] = set()
    while len(names) < num_sentences:
        names.add(f"{rng.choice(FIRST_SYLLABLES)}{rng.choice(SECOND_SYLLABLES)} {rng.choice(KINDS)}")
    target, *others = rng.sample(sorted(names), num_sentences)  # sorted first: set order varies across runs
    claim_attribute, other_attribute = rng.sample(sorted(ATTRIBUTES), 2)
    pool = ATTRIBUTES[claim_attribute][2]
    true_value = rng.choice(pool)
    claim_value = true_value if label != "REFUTES" else rng.choice([value for value in pool if value != true_value])
    claim = ATTRIBUTES[claim_attribute][1].format(entity=target, value=claim_value)

    sentences: list[str] = []
    if label != "NOT_ENOUGH_INFO":
        sentences.append(_sentence(claim_attribute, target, true_value))
    # NOT_ENOUGH_INFO always mentions the claimed company (with another attribute); the others sometimes do,
    # so "the company is named" never decides the label on its own.
    if label == "NOT_ENOUGH_INFO" or rng.random() < 0.5:
        sentences.append(_sentence(other_attribute, target, rng.choice(ATTRIBUTES[other_attribute][2])))
    # Distractors: other companies, never with the claimed attribute, so exactly one sentence decides the label.
    distractor_attributes = [name for name in sorted(ATTRIBUTES) if name != claim_attribute]
    for entity in others[: num_sentences - len(sentences)]:
        attribute = rng.choice(distractor_attributes)
        sentences.append(_sentence(attribute, entity, rng.choice(ATTRIBUTES[attribute][2])))
    order = list(range(len(sentences)))
    rng.shuffle(order)
    shuffled = [sentences[position] for position in order]
    evidence = [order.index(0)] if label != "NOT_ENOUGH_INFO" else []
    return claim, shuffled, evidence


def generate_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """`n` rows, labels balanced (counts differ by at most one) in a seeded random order; same seed, same rows."""
    rng = random.Random(seed)
    labels = [LABELS[i % len(LABELS)] for i in range(n)]
    rng.shuffle(labels)
    rows = []
    for index, label in enumerate(labels):
        claim, sentences, evidence = generate_example(rng, label)
        rows.append(evidence_row(claim, TITLE, sentences, label, evidence, index=index, split=split,
                                 generator_seed=seed))
    return rows


@exit_on_bad_input()
def main(argv: list[str] | None = None, generate=generate_rows, module: str = "data.synthetic",
         description: str = __doc__) -> None:
    """The command of a row generator `generate(n, seed, split)` (this task's, or data.arithmetic's)."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description.splitlines()[0])
    parser.add_argument("--n", type=int, required=True, help="number of rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", default="train", help="written to extra_info.split")
    parser.add_argument("--out", required=True, help="output .jsonl or .parquet file")
    args = parser.parse_args(argv)
    if args.n < 1:
        raise ValueError(f"--n must be at least 1, got {args.n}")
    rows = generate(args.n, args.seed, args.split)
    write_rows(rows, Path(args.out))
    print(f"{args.out}: {len(rows)} rows (seed {args.seed})")


if __name__ == "__main__":
    main()
