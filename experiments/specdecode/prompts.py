"""Prompts of the speculative-decoding experiment: (a) repetitive, (b) free-form chat.

Two disjoint splits (docs/protocol.md): dev prompts choose the policy, test prompts are
scored with it.

Repetitive prompts ask the model to restate or edit text in its context (the case prompt
lookup targets: editing code/docs, repeating a document); free-form ones are open chat
questions whose answers mostly do not copy the prompt.
"""

from research.core.splits import Splits

PARAGRAPH = (
    "The cat sat on the warm windowsill every afternoon, watching the birds in the garden. "
    "When the sun moved behind the old oak tree, the cat would stretch, yawn, and walk "
    "slowly to the kitchen, hoping that someone had left a little milk in its blue bowl.")

CODE = '''def moving_average(values, window):
    """Return the moving average of values over a window."""
    result = []
    total = 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''

DOC = ("Installation\n\n1. Download the installer from the releases page.\n"
       "2. Run the installer and accept the license agreement.\n"
       "3. Choose the installation folder and press Next.\n"
       "4. Wait until the progress bar is full, then press Finish.\n")

# (text, use the chat template?). Dev prompts choose the draft-length policy
# (`specdecode.py:dev`); test prompts are scored with it (`:small`, `:full`): every prompt
# here is run by one of the two, and `SPLITS` raises at import if a prompt were in both.
DEV_REPETITIVE = (
    (f"Repeat the following text exactly:\n\n{PARAGRAPH}", True),
    (f"Rewrite these instructions word for word, but number the steps with letters:\n\n{DOC}",
     True),
)
DEV_FREE_FORM = tuple((t, True) for t in (
    "Explain how a rainbow forms.",
    "Give me some tips for learning a new language.",
    "Write a poem about the ocean.",
))
REPETITIVE = (  # test: the lead engineer's two examples, then the code edit
    (f"Rewrite the following paragraph, replacing 'cat' with 'dog':\n\n{PARAGRAPH}", True),
    (DOC + "\n" + DOC + "\n" + DOC[:80], False),  # a document that repeats: continue it
    # SmolLM2-135M does not restate code it is asked to edit (it rewrites the body), so
    # this one shows what happens when a "repetitive" task is not answered repetitively
    (f"Return this function with a longer docstring; keep the code the same:\n\n{CODE}", True),
)
FREE_FORM = tuple((t, True) for t in (  # test
    "What are three benefits of regular exercise?",
    "Write a short story about a robot who learns to paint.",
    "Why is the sky blue?",
))
SPLITS = Splits("specdecode prompts", dev=DEV_REPETITIVE + DEV_FREE_FORM,
                test=REPETITIVE + FREE_FORM)
PROMPTS = {"dev": (DEV_REPETITIVE, DEV_FREE_FORM), "test": (REPETITIVE, FREE_FORM)}
