#!/usr/bin/env python3
"""A deterministic tiny SentencePiece (unigram) tokenizer.model with exactly N pieces, written by hand as a
ModelProto, so that llama.cpp's convert_hf_to_gguf.py (class Gemma3NModel -> Gemma3Model.set_vocab ->
_set_vocab_sentencepiece) can turn the tiny random Gemma 3n models into complete GGUFs whose vocabulary size
equals the model's.

It is NOT the real Gemma 3n tokenizer (262,144 pieces). The fixtures feed token ids directly; this exists only so
that the GGUF is complete and loadable.

Layout: 0 <pad>, 1 <eos>, 2 <bos>, 3 <unk>, 4 <mask>, 5 <start_of_turn>, 6 <end_of_turn> (control tokens; unk is
UNKNOWN), 7 '\n', 8 '\u2581' (space marker), 9..102 printable ASCII '!'..'~', then whole words of CORPUS prefixed
with '\u2581' (most frequent first, ties by spelling) until N pieces. Scores: -(id) so earlier pieces win.
"""
import collections, os, sys

CONTROL = ["<pad>", "<eos>", "<bos>"]
CORPUS = ("the of and to in is was that for on as with by he at from his an were are which this be or has had "
          "not but first one their its new after who they have her she two been other when there all during into "
          "school time may years more most only over city some world would where later up such used many can state "
          "about national out known university united then made year him than these under well what also you game "
          "music film team three world him like people work part made being both each between while because every "
          "capital france paris once upon small village lived old man sons quick brown fox jumps lazy dog hello "
          "model engine token logits reference weights random tests compare position sequence oracle print def "
          "return else while true pass break continue range import class self none false list dict string number "
          "zero four five six seven eight nine ten red green blue black white")


def pieces(n):
    p = CONTROL + ["<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "\n", "\u2581"]
    p += [chr(c) for c in range(33, 127)]
    words = collections.Counter(CORPUS.split())
    for w, _ in sorted(words.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(p) >= n:
            break
        if "\u2581" + w not in p:
            p.append("\u2581" + w)
    if len(p) < n:
        raise RuntimeError(f"corpus gives only {len(p)} pieces")
    return p[:n]


def write(d, n):
    from sentencepiece import sentencepiece_model_pb2 as pb
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.UNIGRAM
    m.trainer_spec.vocab_size = n
    m.trainer_spec.pad_id, m.trainer_spec.eos_id, m.trainer_spec.bos_id, m.trainer_spec.unk_id = 0, 1, 2, 3
    m.trainer_spec.byte_fallback = False
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, t in enumerate(pieces(n)):
        sp = m.pieces.add()
        sp.piece, sp.score = t, -float(i)
        if t in CONTROL or t in ("<start_of_turn>", "<end_of_turn>"):
            sp.type = pb.ModelProto.SentencePiece.CONTROL
        elif t == "<unk>":
            sp.type = pb.ModelProto.SentencePiece.UNKNOWN
        elif t == "<mask>":
            sp.type = pb.ModelProto.SentencePiece.USER_DEFINED
        else:
            sp.type = pb.ModelProto.SentencePiece.NORMAL
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.model"), "wb") as f:
        f.write(m.SerializeToString())
    import json
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
                   "unk_token": "<unk>", "pad_token": "<pad>", "add_bos_token": True, "add_eos_token": False,
                   "note": f"tiny {n}-piece test tokenizer for the random Gemma 3n fixtures; NOT the real one"},
                  f, indent=1)


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256)
    from sentencepiece import SentencePieceProcessor
    s = SentencePieceProcessor(model_file=os.path.join(sys.argv[1], "tokenizer.model"))
    print(s.vocab_size(), s.encode("the capital of france is paris"), s.IdToPiece(8))
