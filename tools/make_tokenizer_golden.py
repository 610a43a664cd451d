#!/usr/bin/env python3
"""Golden token ids for tests/unit/test_tokenizer.cpp, computed with Hugging Face `tokenizers`.

Two modes:

  make_tokenizer_golden.py write-fixtures --fixtures tests/fixtures/tokenizer
      Writes the generated, deterministic parts of the corpus (no HF needed): fuzz.jsonl (random
      strings built from tricky pieces, fixed seed), variants.json (JSON merge patches, RFC 7386,
      that turn the Qwen3 tokenizer.json into Llama-3 / GPT-2 style and edge-case variants) and
      tiny_*.json (small hand-made BPE tokenizers: subword prefix/suffix + fused unk, byte fallback).
      The hand-written corpus files live in corpus/*.txt.

  make_tokenizer_golden.py golden --tokenizer qwen3/tokenizer.json [--tokenizer-config tokenizer_config.json]
                                  --fixtures tests/fixtures/tokenizer --out tests/fixtures/tokenizer/expected.json
      Encodes every case with every tokenizer through `tokenizers.Tokenizer` and writes the ids,
      the special-token wrapping added by add_special_tokens=True and the decoded text. With
      --tokenizer-config it also renders the Qwen3 chat template through transformers'
      apply_chat_template for a few conversations (checked against engine/chat.h).

Case texts are read as bytes and decoded as UTF-8 (no newline translation).
"""
import argparse
import copy
import hashlib
import json
import os
import random
import sys
import unicodedata

QWEN3_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
N_FUZZ = 240
N_FUZZ_VARIANTS = 80  # variants and tiny tokenizers see the corpus plus this many fuzz strings


# ---------------------------------------------------------------------------------------------
# write-fixtures

def fuzz_pieces():
    """Pieces that stress the regex split, normalisation, added tokens and byte-level BPE."""
    p = []
    p += ["the", "The", "THE", "token", "Tokenizer", "hello", "world", "café", "naïve", "x", "I", "a"]
    p += [" ", "  ", "   ", " " * 9, "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", "\n\r", " \n", "\t\n "]
    p += ["\u00a0", "\u0085", "\u180e", "\u2000", "\u2009", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000",
          "\u200b", "\x0b", "\x0c", "\x1c", "\x1f"]
    p += ["0", "7", "42", "123", "2024", "3.14", "1,000", "99999999", "\u0663", "\uff17", "\u00b2", "\u00bd", "\u2167"]
    p += ["'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'M", "'ll", "'LL", "'d", "'", "''", "\u2019s", "'\u017f", "n't"]
    p += [".", ",", "!", "?", "...", "--", "-", "_", "(", ")", "[", "]", "{", "}", "<", ">", "/", "\\", "#", "@", "$",
          "%", "^", "&", "*", "+", "=", "|", "~", "`", "\"", ";", ":", "->", "=>", "::", "//", "/*", "*/", "{{", "}}"]
    p += ["\u4e2d", "\u6587", "\u4eca\u5929", "\u3002", "\uff0c", "\u3042", "\u30a2", "\uff71", "\ud55c", "\uae00",
          "\u1100", "\u1161", "\u11a8", "\uac00", "\uf900", "\U00020000"]
    p += ["\U0001F600", "\U0001F44D", "\U0001F3FD", "\u200d", "\ufe0f", "\ufe0e", "\u2764", "\U0001F1FA\U0001F1F8",
          "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\u20e3", "\U0001FAE0"]
    p += ["\u0301", "\u0300", "\u0308", "\u0323", "\u0302", "\u030a", "\u0344", "e\u0301", "A\u030a", "\u212b",
          "\u2126", "\u00e9", "\u00c5", "\ufb01", "\u0958", "\u093c", "\u0915"]
    p += ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "<|im_start",
          "im_end|>", "<|", "|>", "<mask>", "[R]", "@@", "Cafe\u0301!", "<SPECIAL_N>", "system"]
    p += ["\x00", "\x07", "\x1b", "\x7f", "\u0080", "\u009f", "\u00ad", "\ufeff", "\u200e", "\ufffd", "\ue000", "\U0010ffff"]
    p += ["\u0645\u0631\u062d\u0628\u0627", "\u05e9\u05dc\u05d5\u05dd", "\u0928\u092e\u0938\u094d\u0924\u0947",
          "\u0e2a\u0e27\u0e31\u0e2a", "\u041f\u0440\u0438\u0432\u0435\u0442", "\u0393\u03b5\u03b9\u03ac",
          "\uff28\uff45\uff4c\uff4c\uff4f", "\u2200", "\u221e", "\u2192"]
    return p


def write_fuzz(path):
    rnd = random.Random(20240601)
    pieces = fuzz_pieces()
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(N_FUZZ):
            n = rnd.randint(1, 24)
            s = "".join(rnd.choice(pieces) for _ in range(n))
            f.write(json.dumps(s, ensure_ascii=True) + "\n")


LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def template(single, specials):
    return {
        "type": "TemplateProcessing",
        "single": single,
        "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {name: {"id": name, "ids": [i], "tokens": [name]} for name, i in specials.items()},
    }


def variants(base_added):
    """JSON merge patches over the Qwen3 tokenizer.json."""
    bl = lambda prefix, regex: {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": True,
                                "use_regex": regex}
    added = copy.deepcopy(base_added)
    for t in added:
        if t["content"] == "<|im_start|>":
            t["lstrip"] = True
        if t["content"] == "<|im_end|>":
            t["rstrip"] = True
    extra = [
        # (content, id as HF assigns it, flags)
        ("<mask>", 151669, dict(lstrip=True, special=True, normalized=False)),
        ("[R]", 151670, dict(rstrip=True, special=False, normalized=False)),
        ("@@", 19191, dict(single_word=True, special=False, normalized=False)),  # already in the vocab
        ("Cafe\u0301!", 151671, dict(special=False, normalized=True)),  # matched as its NFC form
        ("hello", 14990, dict(single_word=True, special=False, normalized=True)),  # already in the vocab
        ("<|im_start|>system", 151672, dict(special=False, normalized=False)),  # overlaps <|im_start|>
        ("<SPECIAL_N>", 151673, dict(special=True, normalized=True)),
        ("\u212b", 151674, dict(special=False, normalized=True)),  # Angstrom sign, NFC -> U+00C5
    ]
    for content, i, flags in extra:
        t = {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": True, "special": False}
        t.update(flags)
        added.append(t)
    return {
        "llama3_style": {
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
                bl(False, False)]},
            "post_processor": {"type": "Sequence", "processors": [
                bl(True, True),
                template([{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}}], {"<|endoftext|>": 151643})]},
            "model": {"ignore_merges": True},
        },
        "gpt2_style": {
            "normalizer": None,
            "pre_tokenizer": bl(True, True),
            "post_processor": template([{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}},
                                        {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}}],
                                       {"<|im_start|>": 151644, "<|im_end|>": 151645}),
            "decoder": {"type": "Sequence", "decoders": [bl(True, True)]},
        },
        "added_token_flags": {"added_tokens": added},
        "split_behaviors": {
            "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKD"}, {"type": "NFC"}]},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "(?=[A-Z])"}, "behavior": "Isolated", "invert": False},
                {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
                {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "MergedWithNext", "invert": False},
                {"type": "Split", "pattern": {"Regex": "[,.;:!?]"}, "behavior": "Contiguous", "invert": False},
                {"type": "Split", "pattern": {"Regex": "-"}, "behavior": "MergedWithPrevious", "invert": True},
                {"type": "Split", "pattern": {"String": "xq"}, "behavior": "Removed", "invert": False},
                bl(True, False)]},
        },
        "nfd": {"normalizer": {"type": "NFD"}},
    }


def tiny_subword():
    """BPE with continuing_subword_prefix "##", end_of_word_suffix "</w>", fused unk, NFD, Bert post."""
    vocab = {"<unk>": 0, "[CLS]": 1, "[SEP]": 2}
    letters = "abcdefghijklmnopqrstuvwxyz"
    for form in ("{}", "##{}", "{}</w>", "##{}</w>"):
        for c in letters:
            vocab[form.format(c)] = len(vocab)
    merges = ["l ##o", "lo ##w</w>", "lo ##w", "##e ##r</w>", "low ##er</w>", "n ##e", "ne ##w", "##e ##s",
              "##es ##t</w>", "new ##est</w>", "w ##i", "wi ##d", "wid ##est</w>", "##o ##w</w>"]
    prefix = "##"
    for m in merges:
        a, b = m.split(" ")
        merged = a + b[len(prefix):]
        if merged not in vocab:
            vocab[merged] = len(vocab)
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [
            {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": True} for c, i in (("<unk>", 0), ("[CLS]", 1), ("[SEP]", 2))],
        "normalizer": {"type": "NFD"},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Removed", "invert": False},
        "post_processor": {"type": "BertProcessing", "sep": ["[SEP]", 2], "cls": ["[CLS]", 1]},
        "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": prefix,
                  "end_of_word_suffix": "</w>", "fuse_unk": True, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def tiny_byte_fallback():
    """BPE over characters with byte_fallback (<0xXX> tokens), no pre-tokenizer, merges as pairs."""
    vocab = {"<unk>": 0}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for c in ["a", "b", "c", "d", "e", " ", "\u00e9"]:
        vocab[c] = len(vocab)
    merges = [["a", "b"], ["ab", "c"], ["c", "d"], [" ", "a"], ["abc", "d"]]
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


TINY_CASES = ["low lower newest widest", "lowest  new\tlow", "Cafe\u0301 x\u00e9y", "abcd abcde", "xyz",
              "\u00e9\U0001F600", "a b  c", "", "ab\u00e9cd", "LOW low"]


def write_fixtures(fixtures, base_tokenizer):
    write_fuzz(os.path.join(fixtures, "fuzz.jsonl"))
    with open(base_tokenizer, encoding="utf-8") as f:
        base = json.load(f)
    with open(os.path.join(fixtures, "variants.json"), "w", encoding="utf-8") as f:
        json.dump(variants(base["added_tokens"]), f, indent=1, ensure_ascii=True)
        f.write("\n")
    for name, tok in (("tiny_subword", tiny_subword()), ("tiny_byte_fallback", tiny_byte_fallback())):
        with open(os.path.join(fixtures, name + ".json"), "w", encoding="utf-8") as f:
            json.dump(tok, f, indent=1, ensure_ascii=True)
            f.write("\n")
        with open(os.path.join(fixtures, "tiny_cases.json"), "w", encoding="utf-8") as f:
            json.dump(TINY_CASES, f, ensure_ascii=True)
            f.write("\n")


# ---------------------------------------------------------------------------------------------
# golden

def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (nlohmann::json::merge_patch implements the same)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def load_cases(fixtures):
    cases = []
    corpus = os.path.join(fixtures, "corpus")
    for name in sorted(os.listdir(corpus)):
        if name.endswith(".txt"):
            with open(os.path.join(corpus, name), "rb") as f:
                cases.append((name, f.read().decode("utf-8")))
    with open(os.path.join(fixtures, "fuzz.jsonl"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            cases.append(("fuzz_%03d" % i, json.loads(line)))
    return cases


def encode_cases(tok, cases):
    out = []
    for name, text in cases:
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_sp = tok.encode(text, add_special_tokens=True).ids
        # add_special_tokens only wraps the sequence: record the wrapping, not a second copy.
        k = next((k for k in range(len(ids_sp) - len(ids) + 1) if ids_sp[k:k + len(ids)] == ids), None)
        if k is None:
            raise SystemExit("%s: add_special_tokens=True does not wrap the plain ids" % name)
        out.append({
            "name": name,
            "ids": ids,
            "prefix": ids_sp[:k],
            "suffix": ids_sp[k + len(ids):],
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    return out


CHAT_CASES = [
    ([{"role": "user", "content": "What is PIC?"}], True, None),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], True, None),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
      {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2\nwith lines"}], True, None),
    ([{"role": "user", "content": "Hi"}], True, False),
    ([{"role": "user", "content": "Hi"}], False, None),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "\n\nFinal answer"}], False, None),
    ([{"role": "user", "content": "Q"}, {"role": "system", "content": "late system"},
      {"role": "user", "content": "Q2"}], True, None),
]


def chat_goldens(tokenizer_path, config_path):
    """Renders CHAT_CASES with transformers' apply_chat_template; if that API is unavailable, with
    jinja2 configured as transformers configures it (sandboxed, trim_blocks, lstrip_blocks)."""
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    try:
        from transformers import PreTrainedTokenizerFast
        tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_path)

        def render(messages, gen, kwargs):
            return tok.apply_chat_template(messages, chat_template=cfg["chat_template"], tokenize=False,
                                           add_generation_prompt=gen, **kwargs)
        how = "transformers.apply_chat_template"
    except Exception as e:  # noqa: BLE001
        print("note: transformers apply_chat_template unavailable (%s); using jinja2" % e, file=sys.stderr)
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        tmpl = env.from_string(cfg["chat_template"])

        def render(messages, gen, kwargs):
            return tmpl.render(messages=messages, add_generation_prompt=gen, **kwargs)
        how = "jinja2"
    out = []
    for messages, gen, thinking in CHAT_CASES:
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        out.append({"messages": messages, "add_generation_prompt": gen, "disable_thinking": thinking is False,
                    "text": render(messages, gen, kwargs), "rendered_by": how})
    return out


def golden(args):
    import tokenizers
    from tokenizers import Tokenizer

    with open(args.tokenizer, "rb") as f:
        raw = f.read()
    sha = hashlib.sha256(raw).hexdigest()
    if sha != QWEN3_SHA256:
        raise SystemExit("unexpected tokenizer.json sha256 %s" % sha)
    base = json.loads(raw.decode("utf-8"))
    cases = load_cases(args.fixtures)
    fewer = [c for c in cases if not c[0].startswith("fuzz_")] + \
            [c for c in cases if c[0].startswith("fuzz_")][:N_FUZZ_VARIANTS]

    result = {"tokenizers_version": tokenizers.__version__, "tokenizer_sha256": sha, "tokenizers": {}}
    qwen = Tokenizer.from_str(raw.decode("utf-8"))
    entries = encode_cases(qwen, cases)
    for (name, text), e in zip(cases, entries):
        if e["decoded"] != unicodedata.normalize("NFC", text):
            print("note: %s: HF decode(encode(x)) != NFC(x)" % name, file=sys.stderr)
    result["tokenizers"]["qwen3"] = {"patch": None, "file": None, "cases": entries}

    with open(os.path.join(args.fixtures, "variants.json"), encoding="utf-8") as f:
        patches = json.load(f)
    for vname, patch in patches.items():
        tok = Tokenizer.from_str(json.dumps(merge_patch(base, patch)))
        result["tokenizers"][vname] = {"patch": vname, "file": None, "cases": encode_cases(tok, fewer)}

    with open(os.path.join(args.fixtures, "tiny_cases.json"), encoding="utf-8") as f:
        tiny_cases = [("tiny_%02d" % i, s) for i, s in enumerate(json.load(f))]
    for fname in ("tiny_subword.json", "tiny_byte_fallback.json"):
        tok = Tokenizer.from_file(os.path.join(args.fixtures, fname))
        result["tokenizers"][fname[:-5]] = {"patch": None, "file": fname,
                                            "cases": encode_cases(tok, tiny_cases + fewer[:12])}

    if args.tokenizer_config:
        import transformers
        result["transformers_version"] = transformers.__version__
        result["chat"] = chat_goldens(args.tokenizer, args.tokenizer_config)

    with open(args.out, "w", encoding="utf-8") as f:
        f.write("{\n")
        f.write('"tokenizers_version": %s,\n' % json.dumps(result["tokenizers_version"]))
        if "transformers_version" in result:
            f.write('"transformers_version": %s,\n' % json.dumps(result["transformers_version"]))
        f.write('"tokenizer_sha256": %s,\n' % json.dumps(sha))
        if "chat" in result:
            f.write('"chat": %s,\n' % json.dumps(result["chat"], ensure_ascii=True))
        f.write('"tokenizers": {\n')
        names = list(result["tokenizers"])
        for i, n in enumerate(names):
            t = result["tokenizers"][n]
            f.write(' %s: {"patch": %s, "file": %s, "cases": [\n' % (json.dumps(n), json.dumps(t["patch"]),
                                                                     json.dumps(t["file"])))
            f.write(",\n".join("  " + json.dumps(c, ensure_ascii=True, separators=(",", ":")) for c in t["cases"]))
            f.write("\n ]}%s\n" % ("," if i + 1 < len(names) else ""))
        f.write("}}\n")
    total = sum(len(c["ids"]) for t in result["tokenizers"].values() for c in t["cases"])
    print("wrote %s: tokenizers %s, %d tokenizers, %d cases, %d ids" % (
        args.out, tokenizers.__version__, len(result["tokenizers"]),
        sum(len(t["cases"]) for t in result["tokenizers"].values()), total))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    w = sub.add_parser("write-fixtures")
    w.add_argument("--fixtures", required=True)
    w.add_argument("--tokenizer", required=True, help="the Qwen3 tokenizer.json (for its added_tokens)")
    g = sub.add_parser("golden")
    g.add_argument("--tokenizer", required=True)
    g.add_argument("--tokenizer-config", help="Qwen3 tokenizer_config.json (chat template goldens)")
    g.add_argument("--fixtures", required=True)
    g.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.mode == "write-fixtures":
        write_fixtures(args.fixtures, args.tokenizer)
    else:
        golden(args)


if __name__ == "__main__":
    main()
