#!/usr/bin/env python3
"""The multi-document question-answering task that hypic's trained checkpoints learn (issue 12).

Python 3 standard library only, so the same generator serves the training script (tools/train_task_model.py,
GPU host), the held-out sets the quality benchmark reads (`hypic-eval --dataset`) and anyone reading the task.

A prompt is a list of documents (each one segment, tokenised on its own, as the router does) followed by
one question (the query segment); the answer is generated after it and ends with <|endoftext|>.

Documents are registries of made-up people, one fact per line:
    The code of Kalomir is 4821.                 (code fact)
    Kalomir reports to Bevasel.                  (link fact: the code of Bevasel is in ANOTHER document)
    The motto of Kalomir is "river open gold".   (motto fact, three to five words)
    Kalomir lives in Tamber.                     (filler fact, never asked about)
Names are two or three syllables from a small set, so near-identical names (Kalomir / Kalomer) are common
distractors, across documents and within them.

Questions (the query), three kinds; the query ends by restating the fact's opening words, so that the answer
continues a phrase of a document (the lookup a model learns first, by matching it, "induction"):
    one_hop  'Question: What is the code of Kalomir?\\nAnswer: The code of Kalomir is'  -> ' 4821'
    two_hop  'Question: What is the code of the person Kalomir reports to?\\nAnswer: Kalomir reports to'
             -> ' Bevasel. The code of Bevasel is 7310'
             (two documents: the link fact, then the code fact of the person it names, which the answer states
             before the code: the second hop is a lookup of what the model has just written)
    recall   'Question: What is the motto of Kalomir?\\nAnswer: The motto of Kalomir is "'  -> 'river open gold'
             (recall of a passage, word for word)
    last     'Question: Which registry is listed last?\\nAnswer: The last registry is'  -> ' Tamber'
             (the header of the last document; headers are distinct within a prompt)
    latest   'Question: What is the latest code of Kalomir?\\nAnswer: The latest code of Kalomir is'  -> ' 9012'
             (Kalomir's code is stated in two to four documents, in the same words, with different values; the
             answer is the value of the last document that states it: a later document updates an earlier one,
             as a newer tool result or memory file does in agent prompts)
`last` and `latest` are the order-dependent kinds: their answers depend on where the documents sit relative to
each other, not on one fact. A model can answer them from its linear layers' state (a Gated DeltaNet's delta rule
overwrites the value under a key, S <- (I - b k k^T) S + b k v^T, which composing segments with their transition
operators keeps and naive state addition does not) or from attention over positions; which one a checkpoint
uses is for the benchmark to show. The checkpoints of models/trained/ answer from attention: naive addition and
exact composition answer alike, and what splicing loses on these kinds is the RoPE fix, the seam window at each
document's head, and, for `latest`, the attention of a restatement to the statement before it
(bench/results/quality.md).

Every prompt is fully determined by its random.Random generator, so a seed gives the same prompts on any
machine with the same Python major version.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

SYLLABLES = ["ka", "lo", "mir", "ve", "sel", "tor", "bi", "nu", "gar", "fen", "li", "os", "pra", "dun", "zu",
             "mer", "hal", "dri", "co", "ta", "ri", "sun", "bel", "ar", "ix", "mo", "pe", "qua", "ren", "vi"]
WORDS = ("river open gold quiet stone bright winter morning silver garden ocean patient honest simple green "
         "forward steady humble brave north light field clear deep swift warm kind strong free true calm wise "
         "bold fair grand proud early late high wide long small first last always never every other still "
         "iron paper glass water fire earth cloud storm shadow mountain valley forest bridge tower harbor "
         "candle lantern anchor arrow compass journey promise secret answer question reason wonder balance "
         "harvest season signal market letter window door table chair road path gate wall roof floor "
         "music voice story memory dream hope trust faith order peace work rest play grow build keep share "
         "learn teach carry follow lead guard watch listen").split()
PLACES = ["Tamber", "Osk", "Verrin", "Lume", "Halbrook", "Quenta", "Dorsa", "Pellam", "Ivry", "Marsk",
          "Ondel", "Brisk", "Calder", "Fenwick", "Zarra", "Ulm", "Tessaly", "Grove", "Norrin", "Ashby",
          "Belmoor", "Cresta", "Durn", "Elmsworth", "Farro", "Gallow", "Hessen", "Irwen", "Jarrow", "Kestel",
          "Lorne", "Mirrow", "Nettle", "Orrin", "Parsk", "Quill", "Rosk", "Selby", "Thorne", "Umber"]

KINDS = ("one_hop", "two_hop", "recall", "last", "latest")
DEFAULT_KIND_WEIGHTS = (0.2, 0.2, 0.2, 0.2, 0.2)   # each kind equally often (where the prompt has one)

# Characters per token of this text under the task tokenizer (measured on generated documents with the
# 2048-token BPE of tools/train_task_model.py); used only when no token counter is given.
CHARS_PER_TOKEN = 3.3


@dataclass
class Fact:
    kind: str          # "code" | "link" | "motto" | "lives"
    subject: str       # the person the fact is about
    value: str         # the code, the linked person, the motto words, or the place

    def sentence(self) -> str:
        if self.kind == "code":
            return f"The code of {self.subject} is {self.value}."
        if self.kind == "link":
            return f"{self.subject} reports to {self.value}."
        if self.kind == "motto":
            return f'The motto of {self.subject} is "{self.value}".'
        return f"{self.subject} lives in {self.value}."


@dataclass
class Question:
    kind: str          # one of KINDS
    query: str         # the query segment's text
    answer: str        # the expected completion (leading space included), before <|endoftext|>
    doc_indices: list[int] = field(default_factory=list)   # documents holding the facts needed


@dataclass
class Prompt:
    documents: list[str]
    questions: list[Question]


class _Names:
    """Unique made-up names for one prompt."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def new(self) -> str:
        for _ in range(1000):
            n = 2 if self.rng.random() < 0.3 else 3
            name = "".join(self.rng.choice(SYLLABLES) for _ in range(n)).capitalize()
            if name not in self.used:
                self.used.add(name)
                return name
        raise RuntimeError("name space exhausted: too many facts in one prompt")


def _query(kind: str, subject: str) -> str:
    if kind == "one_hop":
        return f"Question: What is the code of {subject}?\nAnswer: The code of {subject} is"
    if kind == "two_hop":
        return f"Question: What is the code of the person {subject} reports to?\nAnswer: {subject} reports to"
    if kind == "last":
        return "Question: Which registry is listed last?\nAnswer: The last registry is"
    if kind == "latest":
        return f"Question: What is the latest code of {subject}?\nAnswer: The latest code of {subject} is"
    return f'Question: What is the motto of {subject}?\nAnswer: The motto of {subject} is "'


def log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi], log-uniformly distributed."""
    if hi <= lo:
        return lo
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def make_prompt(rng: random.Random, doc_tokens: list[int], num_questions: int,
                count_tokens: Optional[Callable[[str], int]] = None,
                kind_weights: tuple[float, ...] = DEFAULT_KIND_WEIGHTS) -> Prompt:
    """One prompt: len(doc_tokens) documents, document i filled with facts until it holds about
    doc_tokens[i] tokens (count_tokens(text) when given, else len(text) / CHARS_PER_TOKEN; a document may end
    up to one fact line longer, and a document receiving another's linked code fact or a code update a line longer
    still),
    then up to num_questions questions about distinct people, drawn by kind_weights over KINDS (kinds with no
    candidate fact are skipped). Needs at least two documents for two_hop, last and latest questions. A code
    with updates is stated in one document and restated with new values in 1-3 later ones (distinct documents). Documents are headed
"Registry of <place>" with places distinct within the prompt (drawn with repeats past len(PLACES) documents)."""
    n_docs = len(doc_tokens)
    if n_docs < 1:
        raise ValueError("a prompt needs at least one document")
    names = _Names(rng)
    count = count_tokens or (lambda s: int(len(s) / CHARS_PER_TOKEN + 0.5))
    docs: list[list[Fact]] = [[] for _ in range(n_docs)]
    pending: list[list[Fact]] = [[] for _ in range(n_docs)]   # code facts of linked people, placed later
    links: list[tuple[int, Fact, int]] = []                    # (doc of the link fact, link fact, doc of the code)
    versions: dict[str, list[tuple[int, str]]] = {}           # person -> (document, code), codes with updates
    used_tokens = [count(f"Registry of {PLACES[0]}\n") for _ in range(n_docs)]
    for i in range(n_docs):
        # Facts owed to this document by earlier links go in first, at random positions later on.
        for f in pending[i]:
            docs[i].append(f)
            used_tokens[i] += count(f.sentence() + "\n")
        while used_tokens[i] < doc_tokens[i]:
            r = rng.random()
            if r < 0.45 and (r < 0.33 or i == n_docs - 1):
                f = Fact("code", names.new(), str(rng.randint(1000, 9999)))
            elif r < 0.45:
                # a code updated by later documents: the same sentence, new values, in distinct later documents
                later = sorted(rng.sample(range(i + 1, n_docs), min(n_docs - 1 - i, rng.randint(1, 3))))
                values = rng.sample(range(1000, 10000), 1 + len(later))
                f = Fact("code", names.new(), str(values[0]))
                versions[f.subject] = [(i, f.value)]
                for j, v in zip(later, values[1:]):
                    pending[j].append(Fact("code", f.subject, str(v)))
                    versions[f.subject].append((j, str(v)))
            elif r < 0.65 and n_docs > 1:
                target = rng.choice([j for j in range(n_docs) if j != i])
                other = names.new()
                f = Fact("link", names.new(), other)
                code = Fact("code", other, str(rng.randint(1000, 9999)))
                if target > i:
                    pending[target].append(code)
                else:
                    docs[target].insert(rng.randint(0, len(docs[target])), code)
                    used_tokens[target] += count(code.sentence() + "\n")
                links.append((i, f, target))
            elif r < 0.85:
                f = Fact("motto", names.new(), " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 5))))
            else:
                f = Fact("lives", names.new(), rng.choice(PLACES))
            docs[i].append(f)
            used_tokens[i] += count(f.sentence() + "\n")
        rng.shuffle(docs[i])
    heads = rng.sample(PLACES, n_docs) if n_docs <= len(PLACES) else [rng.choice(PLACES) for _ in range(n_docs)]
    texts = [f"Registry of {h}\n" + "".join(f.sentence() + "\n" for f in d) for h, d in zip(heads, docs)]

    # Questions about distinct people.
    codes = [(i, f) for i, d in enumerate(docs) for f in d if f.kind == "code"]
    linked_code = {f.subject for _, f in codes if any(l.value == f.subject for _, l, _ in links)}
    one_hop = [(i, f) for i, f in codes if f.subject not in linked_code and f.subject not in versions]
    latest = [(v[-1][0], s, v) for s, v in versions.items()]
    mottos = [(i, f) for i, d in enumerate(docs) for f in d if f.kind == "motto"]
    code_of = {f.subject: f.value for _, f in codes}
    last = [(n_docs - 1, heads[-1])] if 2 <= n_docs <= len(PLACES) else []
    pools = {"one_hop": one_hop, "two_hop": links, "recall": mottos, "last": last, "latest": latest}
    for p in pools.values():
        rng.shuffle(p)
    questions: list[Question] = []
    asked: set[str] = set()
    for _ in range(num_questions * 4):
        if len(questions) >= num_questions:
            break
        kinds = [k for k in KINDS if pools[k]]
        if not kinds:
            break
        kind = rng.choices(kinds, weights=[kind_weights[KINDS.index(k)] for k in kinds])[0]
        item = pools[kind].pop()
        if kind == "last":
            i, place = item
            # asked first: in a held-out prompt it comes right after the documents, so it does in training
            questions.insert(0, Question(kind, _query(kind, ""), f" {place}", [i]))
            continue
        if kind == "two_hop":
            i, f, j = item
            if f.subject in asked or f.value in asked:
                continue
            q = Question(kind, _query(kind, f.subject),
                         f" {f.value}. The code of {f.value} is {code_of[f.value]}", [i, j])
            asked.update((f.subject, f.value))
        elif kind == "latest":
            i, subject, v = item
            if subject in asked:
                continue
            q = Question(kind, _query(kind, subject), f" {v[-1][1]}", sorted({d for d, _ in v}))
            asked.add(subject)
        else:
            i, f = item
            if f.subject in asked:
                continue
            q = Question(kind, _query(kind, f.subject), f.value if kind == "recall" else f" {f.value}", [i])
            asked.add(f.subject)
        questions.append(q)
    return Prompt(texts, questions)


def sample_shape(rng: random.Random, docs: tuple[int, int], doc_tokens: tuple[int, int]) -> list[int]:
    """Document count log-uniform in docs, each document's token target log-uniform in doc_tokens."""
    n = log_uniform_int(rng, docs[0], docs[1])
    return [log_uniform_int(rng, doc_tokens[0], doc_tokens[1]) for _ in range(n)]


def heldout_record(rng: random.Random, index: int, docs: tuple[int, int], doc_tokens: tuple[int, int],
                   count_tokens: Callable[[str], int], prefix: str = "q") -> dict:
    """One held-out prompt for `hypic-eval --dataset` (one JSON line): documents in prompt order (already
    shuffled: the document holding the answer is anywhere), one question, its answer, the documents it needs,
    each document's token count under count_tokens, and warm_order: the order of an earlier request with the
    same documents (a random permutation), which the prefix mode's cache was warmed with.
    Documents are regenerated until every one has between doc_tokens[0] and doc_tokens[1] tokens."""
    for _ in range(100):
        shape = sample_shape(rng, docs, doc_tokens)
        # fill a little under the target: the last line and linked code facts add a few tokens
        p = make_prompt(rng, [max(doc_tokens[0], t - 30) for t in shape], 1, count_tokens)
        toks = [count_tokens(d) for d in p.documents]
        if p.questions and all(doc_tokens[0] <= t <= doc_tokens[1] for t in toks):
            break
    else:
        raise RuntimeError("could not generate documents within the token range")
    q = p.questions[0]
    order = list(range(len(p.documents)))
    rng.shuffle(order)
    return {"id": f"{prefix}-{index:05d}", "kind": q.kind, "documents": p.documents, "query": q.query,
            "answer": q.answer, "answer_documents": q.doc_indices, "doc_tokens": toks, "warm_order": order}


if __name__ == "__main__":
    import json
    import sys
    rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    p = make_prompt(rng, [60, 80, 50], 6)
    for i, d in enumerate(p.documents):
        print(f"--- document {i}\n{d}")
    for q in p.questions:
        print(json.dumps(q.__dict__))
