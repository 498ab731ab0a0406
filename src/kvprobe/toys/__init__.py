"""Training the toy field-edit models: recipe, data, training and held-out evaluation.

``toy-<family>`` is a 4-layer model (hidden 128, 4 query heads, 2 kv heads, head dim 32, the
family's own RoPE, norms and soft-capping) over the word-level tokenizer, trained from scratch on
raw-form prompts of the field-edit generator. Loss is on the answer token only: the logits at the
last prompt token (the decision position) against the first token of the expected option. Each
is an ordinary Hugging Face folder with a training manifest (:data:`TOY_MANIFEST`) beside it. The six
toys ship inside the package (:data:`SHIPPED`, seed 0), so every machine loads the same weights;
``kvprobe toy train`` reproduces one from its recipe into ``$KVPROBE_HOME/models/toy-<family>/``.

Sliding windows: gemma2 alternates sliding and global layers (sliding, global, sliding, global);
gemma3 slides on layers 0, 1 and 3 with one global layer 2 (local RoPE base 1e4, global 1e6);
mistral slides on every layer. The window is 64 tokens (the family files' ``toy:`` keys), well under a prompt's
length, so the sliding path matters. llama, qwen2 and qwen3 attend globally.

Trained-in behaviours (so that nobody mistakes one for a finding):

- *The decision follows the field value.* Each training case renders with its old or its new
  value, the answer following the value. All eight generator domains, both templates per domain,
  every decision field, all three field positions, 0-6 filler rules.
- *An erratum line overrides the field.* 30% of decision examples carry a state-update paragraph
  before ``## Request``, half in :data:`~kvprobe.datasets.SHORT_ERRATUM` form and half in the
  paper's long template (the editor's default). The answer follows the erratum's value. A quarter
  of those errata restate the field's own value, so the model has to read the erratum's value
  rather than learn "an erratum flips the answer".
- *Negative controls are ignored.* 25% of cases are generator controls (a timestamp, nonce or
  request_id line edited, the answer unchanged), rendered with either control value; control values
  are drawn from the generator's pools. In every example a control line is removed with
  probability 0.2 and an absent one added with probability 0.2. 15% of control cases carry an
  erratum on their *control* field, which must not move the answer either.

So: the decision following the field, an erratum overriding it, and control-invariance are all
trained in. What is *not* trained is how the model implements them: which positions hold notes
about the field, which heads read them, and what a KV edit does. Those are for the probes. Each
decision value has one polarity in every domain (``gold`` always allows), so the toys learn
value -> answer and need not read the rule line.

Recipe (:class:`ToyTrain`): AdamW, lr 3e-3 (2e-3 for mistral and gemma2, see :data:`FAMILY_TRAIN`)
with warm-up and cosine decay, 800 steps of 16 prompts, float32 throughout (eager attention), one
torch thread. (bfloat16 autocast, used before, is emulated on CPUs without AVX-512 BF16, where a
step took 3.5 s instead of 0.37 s, and it takes other kernels on other CPU types.) Batches are
right-padded, so every prompt keeps positions 0..L-1 and the loss reads its last real token,
exactly as an unpadded prefill would.

Held-out evaluation (:func:`evaluate_toy`) draws fresh cases with another seed, up to 9 filler
rules (1.5x the training maximum), and two synthetic unseen domains whose field names and values
were never a decision field or value in training. A model that reads values it memorised scores
chance there (~0.5). That is expected, and reported only so nobody reads more into these models.
"""
