"""The error catalogue: every code a user can meet, its title and its default fix.

`SxError` refuses a code that is not here and, when a raise gives no fix,
takes the fix from here. Every code has a test that provokes it (tests/test_catalogue.py
checks that each is raised somewhere and each raise's fix is its own).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Entry:
  """One code: what it means and how a user usually fixes it."""

  code: str
  title: str
  fix: str


_ENTRIES = (
    # reading and the language
    Entry("E-READ-001", "unbalanced or unexpected `)` `]`; an unclosed form names where it opened",
          "balance the brackets: every `(` and `[` needs its `)` or `]`"),
    Entry("E-READ-002", "unterminated string or bad escape",
          'close the string with `"`; the escapes are \\n \\t \\" \\\\'),
    Entry("E-READ-003", "a token that is no number, symbol or keyword",
          "write a number, a symbol, a :keyword or a \"string\""),
    Entry("E-NAME-001", "an unbound name (the nearest names are suggested)",
          "define the name before using it, or fix its spelling"),
    Entry("E-NAME-002", "a name defined twice (both places)",
          "rename one of the two definitions"),
    Entry("E-FORM-001", "a special form written wrong (arity, a keyword without value)",
          "write the form as its reference shows (docs/language.md)"),
    Entry("E-FORM-002", "an unknown keyword argument (the known ones listed)",
          "use one of the keywords listed"),
    Entry("E-ARG-001", "a function refused an argument's value (its `assert` failed), told at "
          "the user's call", "pass a value the function accepts, as the message says"),
    Entry("E-REQ-001", "a required file not found",
          "give a path relative to the requiring file, or a std/ name"),
    Entry("E-REQ-002", "a cycle of requires (the cycle printed)",
          "move what both files need into a third file that both require"),
    # the selection
    Entry("E-KNOB-001", "an unknown knob in `--set` or a variant",
          "set a knob that the file defines with defknob"),
    Entry("E-KNOB-002", "a value that does not parse as the knob's type",
          "give a value of the knob's type"),
    Entry("E-KNOB-003", "a value outside `:choices`, `:min`, `:max`",
          "give a value within the knob's :choices, :min and :max"),
    Entry("E-VARIANT-001", "an unknown variant (the defined ones listed)",
          "pick one of the variants the file defines"),
    # building the graph
    Entry("E-TYPE-001",
          "a static value expected and a tensor found (or the reverse), or a dtype clash",
          "convert with `cast`, or pass a static number where one is expected"),
    Entry("E-SHAPE-001", "an operation's shapes do not fit (every operand's shape)",
          "make the operands' shapes agree as the operation needs"),
    Entry("E-RUN-001", "no `defrun`, or two",
          "write exactly one (defrun ...) in the experiment"),
    Entry("E-RUN-002", "a `defrun` field missing or invalid (the loss is not a scalar, …)",
          "give every required defrun field a valid value"),
    Entry("E-CURR-001", "a curriculum stage that changes a parameter's shape",
          "change only what keeps every parameter's shape (sequence length, batch, rates)"),
    Entry("E-PARAM-001",
          "another program calls a function the loss calls at several places with different "
          "parameters (or stacks in a repeat): which trained one is meant is ambiguous",
          "name the loss's call meant with :as, and call it with the same :as"),
    # data
    Entry("E-LOAD-001", "a loader's file is missing",
          "check the path (relative to the experiment file) or the URI"),
    Entry("E-LOAD-002", "a loader has fewer records than one microbatch",
          "give the loader more data, or lower :batch"),
    Entry("E-LOAD-003",
          "a token file whose size is not a multiple of its dtype, or a token ≥ the model's "
          "vocabulary",
          "check the file's :dtype and the model's vocabulary size"),
    Entry("E-LOAD-004", "an unreachable or forbidden remote (the URI without credentials)",
          "check the URI, the network and the credentials (AWS_* or GOOGLE_* variables)"),
    Entry("E-LOAD-005",
          "a pass reads more microbatches than its loader's split holds (both counts named)",
          "lower the pass's :batches to the split's microbatches, or give the loader more data"),
    # checkpoints
    Entry("E-CKPT-001", "`--resume latest` without a checkpoint location",
          "give --checkpoint-dir (or SEXPGPU_CHECKPOINT_DIR) with --resume"),
    Entry("E-CKPT-002", "a checkpoint of another experiment (what differs is named)",
          "resume with the experiment, selection and knobs that wrote the checkpoint"),
    Entry("E-CKPT-003", "an unreadable checkpoint",
          "resume from another step, or start afresh without --resume"),
    Entry("E-CKPT-004", "a checkpoint location that cannot be written",
          "give a checkpoint location that exists and can be written"),
    Entry("E-CKPT-005", "a checkpoint location in use by another run (the holder named)",
          "wait for that run to end, or give this run another --checkpoint-dir or "
          "SEXPGPU_RUN_SLUG"),
    Entry("E-CKPT-006",
          "a run without --resume into a location that holds its slug's checkpoints (the "
          "steps named)",
          "--resume latest to continue that run, or another --checkpoint-dir to start over"),
    # outputs and the environment
    Entry("E-METRICS-001", "a metrics target that does not parse or cannot be opened",
          "give targets as jsonl:PATH, tensorboard:DIR, mlflow:URI or wandb:PROJECT[/RUN], "
          "comma-separated"),
    Entry("E-ENV-001", "an environment variable that does not parse",
          "fix or unset the variable named"),
    # devices
    Entry("E-DEV-001",
          "a device that cannot be opened: neither cpu nor cuda, the CUDA plugin missing, or no "
          "GPU visible",
          "--device cpu, or pip install \"sexpgpu[cuda]\" (jax[cuda13]) beside an NVIDIA GPU"),
    Entry("E-DEV-002", "a GPU's compute capability is below 8.0 (the card named)",
          "run on a GPU of compute capability 8.0 or newer, or with --device cpu"),
    Entry("E-DEV-003", "the NVIDIA driver is older than the 580 series",
          "install an NVIDIA driver of the 580 series or newer"),
    Entry("E-PREC-001", "FP8 matmuls asked of a GPU whose compute capability is below 8.9 (the "
          "card and its capability named)",
          "--set precision=bf16 on this card, or an H100, H200, L40S or B200 (8.9 or newer)"),
    Entry("E-PREC-002", "an :fp8 pattern names a weight whose product FP8 does not take (an "
          "einsum of three operands, a convolution): it would stay bf16 unsaid",
          "leave that weight out of :fp8, or write its product as two-operand einsums"),
    Entry("E-MEM-001", "the plan does not fit",
          "lower :batch or the sequence length, use more :microbatches, or a larger card"),
    Entry("E-MEM-002", "a GPU reports no memory statistics, so the plan has nothing to plan "
          "against", "set SEXPGPU_MEMORY to what the run may use of one GPU"),
    # several GPUs and nodes
    Entry("E-DP-001",
          "SEXPGPU_DEVICES does not parse, repeats an ordinal, names one that is not visible, "
          "or no GPU is visible",
          "list visible ordinals once each, SEXPGPU_DEVICES=0,1"),
    Entry("E-DP-002",
          "a resume's rank count, node count or loader rank differs from the checkpoint's; "
          "the message names both",
          "resume with the checkpoint's nodes and devices"),
    Entry("E-DP-003", "the global microbatches do not divide over the GPUs",
          "pick a device count that divides :microbatches"),
    Entry("E-DP-004",
          "the ranks' or the nodes' parameters or optimizer states disagree at a checkpoint",
          "a backend bug, never the experiment's fault: that checkpoint was not written, so "
          "--resume latest continues from the one before; report it with the step and "
          "SEXPGPU_DEVICES"),
    Entry("E-DP-005",
          "SEXPGPU_NODES is not a count, SEXPGPU_NODE_RANK is not in 0..nodes, "
          "SEXPGPU_RENDEZVOUS is not host:port, SEXPGPU_NODE_GRADIENTS is not f32 or bf16, "
          "or the device is not cuda",
          "set all three on every node, with SEXPGPU_DEVICE=cuda"),
    Entry("E-DP-006",
          "a node differs from node 0 at the rendezvous: node count, a node index twice, GPU "
          "count, experiment, gradient dtype, or the checkpoint it resumes; the message names "
          "both",
          "the same files, flags, device count and checkpoint location on every node"),
    Entry("E-DP-007", "a node did not arrive at the rendezvous within 300 s, or left the run",
          "start every node; after a loss, restart every node with --resume latest"),
    # training
    Entry("E-NUM-001", "a non-finite loss with `:on-nan stop`",
          "lower the learning rate, clip gradients, or use `:on-nan skip`"),
    # tools
    Entry("E-BUNDLE-001", "a bundle member with an absolute path or `..`",
          "make the bundle with `sexpgpu bundle`; do not edit its members"),
    Entry("E-BUNDLE-002",
          "a bundle that is not one, or a member that does not match its manifest hash",
          "make the bundle again with `sexpgpu bundle`"),
    Entry("E-BUNDLE-003",
          "a bundle manifest that is not JSON, or a field missing or of the wrong type or value "
          "(the field named, and what it must be)",
          "make the bundle again with `sexpgpu bundle`; its manifest.json is not edited by hand"),
    Entry("E-BUNDLE-004",
          "a bundle past a bound: a member larger than its manifest says, more members or bytes "
          "than a bundle holds, a manifest too large or too deeply nested",
          "do not run the archive; make the bundle again with `sexpgpu bundle`"),
    Entry("E-BUNDLE-005",
          "a bundle that cannot be extracted into the cache folder (full, or not writable)",
          "free space under SEXPGPU_CACHE_DIR, or point it at a disk with room"),
    Entry("E-TOK-001", "a text source that cannot be read (naming it, and the line for `.jsonl`)",
          "give UTF-8 text: .txt, .jsonl with the text --field, or .parquet"),
    Entry("E-TOK-002", "a tokenizer named instead of given as a file",
          "give a tokenizer.json file; nothing is downloaded"),
    Entry("E-CHAT-001",
          "a conversation or preference-pair line of the wrong shape, or one the chat "
          "template refuses (the file and line, and the shape expected)",
          'one JSON object a line: {"messages": [{"role": "user", "content": "..."}, ...]}'),
    Entry("E-CHAT-002",
          "a chat template that cannot be read, does not compile, or cannot locate the "
          "assistant's text (the template's file)",
          "fix the chat_template of tokenizer_config.json, or mark the assistant's text with "
          "{% generation %}"),
    Entry("E-REF-001",
          "a resume whose reference model's starting parameters, read again from `:init-from` "
          "(or drawn from the seed), differ from those the run started from (both digests)",
          "restore the :init-from source as the run started from it, or start a new run"),
    # ops written in Python
    Entry("E-OP-001",
          "an op written in Python failed: its file raised while loading, its declaration "
          "is one the table cannot take, or it raised at a call (the Python file and line)",
          "fix the op's Python file (SEXPGPU_DEBUG=1 prints the whole traceback)"),
    Entry("E-OP-002",
          "Python an experiment requires, not run without --trust-python (every file that "
          "would run listed with its sha256)",
          "read the files, then pass --trust-python or set SEXPGPU_TRUST_PYTHON=1"),
    Entry("E-OP-003",
          "an op written in Python declared of a kind that some table (decode, split, the "
          "backward's) has no rule for (the tables named)",
          'declare a kind every table has a rule for: "pointwise", or "opaque" when its '
          "positions mix"),
    # models in and out
    Entry("E-SAMPLE-001",
          "`sample` cannot tell which function maps tokens to logits (the candidates listed)",
          "pass --fn NAME, a function of the tokens that returns logits [b t vocab]"),
    Entry("E-SAMPLE-002",
          "a continuation past what the model decodes: a learned position table or an "
          "attention window (named, with the longest length it decodes)",
          "ask for fewer tokens, or pass --window recompute to slide the window"),
    Entry("E-GEN-001",
          "`generate` cannot tell which program to run, or its function is not one of no "
          "arguments returning tensors, or the output cannot be written",
          "write (defgenerate NAME :fn F :every N) for a defn F of no arguments, and pass -o "
          "a writable OUT.npz"),
    # downstream evaluation
    Entry("E-EVAL-001",
          "a task file that cannot be read or does not parse (the file and line), or holds "
          "no document",
          'one JSON object a line: {"context": ..., "choices": [...], "gold": i} or '
          '{"text": ...}'),
    Entry("E-EVAL-002",
          "an evaluation without a tokenizer it can use (none known, or no end-of-document "
          "token), or packing asked of a model without :segments and :positions",
          "give defeval :tokenizer FILE (a tokenizer.json), or train on a text loader's "
          "token cache"),
    Entry("E-EVAL-003",
          "a task the model cannot score: no document fits its window, or the tokenizer "
          "writes ids past its vocabulary",
          "shorten the documents, or evaluate with the tokenizer the model was trained with"),
    Entry("E-EXPORT-001",
          "a model with parameters that have no place in the chosen format's twin (naming them)",
          "build the model from std/gpt2, std/llama, std/mixtral or std/mamba, or export with "
          "--format safetensors"),
    # training recipes: parameter roles
    Entry("E-ROLE-001",
          "a parameter whose role something needs (its weight decay) and whose uses in the "
          "graph do not decide it (the roles they imply named)",
          "write :role ROLE on its param (embedding readout hidden expert conv norm bias "
          "other)"),
    Entry("E-MUP-001", "an unknown `:parametrization` (the nearest names suggested)",
          "write :parametrization mup or standard (the default)"),
    Entry("E-MUP-002", "a `:base-width` that is absent under μP or no positive integer",
          "write :base-width N, the width your learning rate was tuned at"),
    Entry("E-MUP-003", "μP cannot read the model's width or place its output multiplier",
          "write :role readout on the param that makes the logits, outside repeat bodies"),
    Entry("E-INIT-001",
          "a warm start whose parameters are missing, extra, or of another shape or dtype "
          "(both sides listed)",
          "start from a checkpoint of the same model, or set :init-partial true for missing "
          "parameters"),
)

CATALOGUE: dict[str, Entry] = {e.code: e for e in _ENTRIES}


def entry(code: str) -> Entry:
  """The catalogue's entry for `code`.

  Raises:
    KeyError: the code is not in the catalogue (a programming error, not a user's).
  """
  return CATALOGUE[code]
