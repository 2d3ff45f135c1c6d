"""One (head, relation, tail) triple per sentence for the corpus co-occurrence reward, `extract(sentence) ->
Triple | None`, by rules (the default) or by a model. A pronoun head or tail is rejected: "She won it" says
nothing a corpus can check."""
from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources
from typing import NamedTuple

PRONOUNS = frozenset(
    "i me my mine myself you your yours yourself yourselves he him his himself she her hers herself it its itself "
    "we us our ours ourselves they them their theirs themselves this that these those who whom whose which what "
    "someone somebody something anyone anybody anything everyone everybody everything one".split())
STOPWORDS = PRONOUNS | frozenset(
    "a an the and or but nor so yet if then than because as of at by for from in into on onto to with within "
    "without about above below over under between among through during before after since until upon via per "
    "is are was were be been being am do does did done has have had having will would shall should can could "
    "may might must not no yes also only just very more most much many some any all each every both either "
    "neither other another such same own there here where when why how while however therefore thus due "
    "like whether although though unless against toward towards around across along despite near out up "
    "down again further once too answer question think final".split())
# Verbs that commonly carry a relation; any lower-case word ending in "ed" is also taken as a verb.
RELATION_WORDS = frozenset(
    "is are was were be been has have had won wins win born died dies located lies lie lived lives founded "
    "wrote writes written directed directs played plays became becomes married discovered invented created "
    "released published served serves led leads contains contain includes include causes cause produces "
    "produce owns own makes make made gave gives received receives holds held belongs belong borders border "
    "flows flow speaks speak uses use means mean equals equal reduces reduce increases increase inhibits "
    "inhibit activates activate binds bind encodes encode affects affect prevents prevent treats treat "
    "developed designed built named called known".split())
_WORD = re.compile(r"[^\W_]+(?:['’\-][^\W_]+)*")
_MAX_SENTENCE_CHARS = 2000  # extraction looks at the start of an overlong "sentence" only (linear cost)
_MAX_SIDE_WORDS = 3
_MAX_PART_CHARS = 120


class Triple(NamedTuple):
    head: str
    relation: str
    tail: str


def content_words(phrase: str) -> list[str]:
    """Words of a phrase that are not stopwords or pronouns, in order, case kept (`COVID-19` stays one word)."""
    return [word for word in _WORD.findall(phrase) if word.lower() not in STOPWORDS]


def query_words(triple: Triple) -> tuple[list[str], list[str]] | None:
    """(head words, tail words) to count, or None when a side is empty: every content word (the corpus paper
    ANDs all content words of subject and object), duplicates removed case-insensitively, also across sides (a
    tail repeating the head would count the head alone)."""
    head: list[str] = []
    tail: list[str] = []
    taken: set[str] = set()
    for side, phrase in ((head, triple.head), (tail, triple.tail)):
        for word in content_words(phrase):
            if word.lower() not in taken:
                taken.add(word.lower())
                side.append(word)
    return (head, tail) if head and tail else None


def _is_verb(word: str) -> bool:
    lower = word.lower()
    return lower in RELATION_WORDS or (word.islower() and len(word) >= 4 and lower.endswith("ed"))


def _is_name_word(word: str) -> bool:
    """Capitalised or numeric, and not a stopword ("The", "In" at a sentence start are not names)."""
    return (word[0].isupper() or word[0].isdigit()) and word.lower() not in STOPWORDS


def _pick(words: list[str], joined: list[bool], *, last: bool) -> list[str]:
    """The last (head) or first (tail) run of name words (joined[i]: only whitespace between words i-1
    and i, so "1903, Marie" is two runs); else the last/first content words (at most 3)."""
    runs: list[list[str]] = []
    for index, word in enumerate(words):
        if _is_name_word(word):
            if runs and index > 0 and joined[index] and _is_name_word(words[index - 1]):
                runs[-1].append(word)
            else:
                runs.append([word])
    if runs:
        return runs[-1] if last else runs[0]
    content = [word for word in words if word.lower() not in STOPWORDS]
    return content[-_MAX_SIDE_WORDS:] if last else content[:_MAX_SIDE_WORDS]


class RuleTripleExtractor:
    """The relation is the first verb-like word after the first word; the head is the last name (capitalised or
    numeric run) before it, else its last content words; the tail the first name after it, else its first
    content words. A pronoun subject or object rejects the sentence."""

    def extract(self, sentence: str) -> Triple | None:
        text = sentence[:_MAX_SENTENCE_CHARS]
        matches = list(_WORD.finditer(text))
        words = [match.group() for match in matches]
        joined = [index > 0 and text[matches[index - 1].end():match.start()].isspace()
                  for index, match in enumerate(matches)]
        relation_index = next((index for index in range(1, len(words)) if _is_verb(words[index])), None)
        if relation_index is None:
            return None
        before, after = words[:relation_index], words[relation_index + 1:]
        if before[-1].lower() in PRONOUNS:
            return None
        object_words = [word for word in after if word.lower() not in STOPWORDS or word.lower() in PRONOUNS]
        if object_words and object_words[0].lower() in PRONOUNS:
            return None
        head = _pick(before, joined[:relation_index], last=True)
        tail = _pick(after, joined[relation_index + 1:], last=False)
        return Triple(" ".join(head), words[relation_index], " ".join(tail)) if head and tail else None


class ModelTripleExtractor:
    """Few-shot extraction (templates/triple_extraction.txt) with any `generate_fn(prompt) -> str`, such as
    launch.reward_pool's greedy local LM: the output's first valid triple (parse_triple), else None. An
    exception in generate_fn propagates: a failing extractor must not look like a sentence without facts."""

    def __init__(self, generate_fn: Callable[[str], str], template: str | None = None) -> None:
        self.generate_fn = generate_fn
        if template is None:  # the few-shot prompt shipped as package data
            template = (resources.files("rewards") / "templates" / "triple_extraction.txt").read_text(encoding="utf-8")
        self.template = template
        if "{sentence}" not in self.template:
            raise ValueError("triple extraction template must contain the placeholder {sentence}")

    def prompt(self, sentence: str) -> str:
        return self.template.replace("{sentence}", " ".join(sentence[:_MAX_SENTENCE_CHARS].split()))

    def extract(self, sentence: str) -> Triple | None:
        return parse_triple(self.generate_fn(self.prompt(sentence)))


def parse_triple(output: object) -> Triple | None:
    """The first valid `head | relation | tail` line (brackets, quotes and a `Triple:` prefix tolerated), or None;
    reading stops at `NONE` or at the next few-shot example (`Sentence:`), so a model that runs on adds nothing.
    Valid: three non-empty parts of at most 120 characters, head and tail non-pronouns with a content word."""
    if not isinstance(output, str):
        return None
    for raw_line in output.splitlines():
        line = re.sub(r"^(?:triple\s*:\s*)", "", raw_line.strip(), flags=re.IGNORECASE).strip().strip("()[]{}<>\"'` ")
        if line.upper() == "NONE" or raw_line.strip().lower().startswith("sentence:"):
            return None
        parts = [part.strip().strip("\"'`").strip() for part in line.split("|")]
        if len(parts) != 3 or not all(parts) or any(len(part) > _MAX_PART_CHARS for part in parts):
            continue
        head, relation, tail = parts
        if {head.lower(), tail.lower()}.isdisjoint(PRONOUNS) and content_words(head) and content_words(tail):
            return Triple(head, relation, tail)
    return None
