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

# Fresh test prompts (issue 36): the test prompts above were scored before the protocol
# (two of each kind were the old policy's tuning prompts), so the headline speedups are
# re-scored once on these, written after the policy was fixed and never run before. The
# same three kinds of repetitive task; the edited paragraph is docstring prose of the
# fresh test text (threading.BoundedSemaphore), new to the project.
SEMAPHORE = (
    "Like regular semaphores, bounded semaphores manage a counter representing the number "
    "of release() calls minus the number of acquire() calls, plus an initial value. The "
    "acquire() method blocks if necessary until it can return without making the counter "
    "negative. If not given, value defaults to 1.")

CHECKLIST = ("Release checklist\n\n- Update the version number in setup.cfg.\n"
             "- Run the full test suite on every supported Python.\n"
             "- Build the wheel and the source archive.\n"
             "- Upload both files and tag the release.\n")

CODE_FRESH = '''def chunked(items, size):
    """Split items into lists of at most size elements."""
    out = []
    for start in range(0, len(items), size):
        out.append(items[start:start + size])
    return out
'''

FRESH_REPETITIVE = (
    (f"Rewrite the following paragraph, replacing 'semaphores' with 'locks':\n\n{SEMAPHORE}",
     True),
    (CHECKLIST + "\n" + CHECKLIST + "\n" + CHECKLIST[:70], False),
    (f"Add a type hint to every argument of this function; keep the body the same:\n\n"
     f"{CODE_FRESH}", True),
)
FRESH_FREE_FORM = tuple((t, True) for t in (
    "How do vaccines train the immune system?",
    "Write a short letter inviting a friend to a picnic.",
    "What should I pack for a week-long hiking trip?",
))
SPLITS = Splits("specdecode prompts", dev=DEV_REPETITIVE + DEV_FREE_FORM,
                test=REPETITIVE + FREE_FORM + FRESH_REPETITIVE + FRESH_FREE_FORM)
PROMPTS = {"dev": (DEV_REPETITIVE, DEV_FREE_FORM), "test": (REPETITIVE, FREE_FORM)}
# the test prompt sets (config.test_prompts): the original ones and the fresh ones
TEST_PROMPTS = {"original": PROMPTS["test"], "fresh": (FRESH_REPETITIVE, FRESH_FREE_FORM)}


def split_prompts(split: str, test_prompts: str = "original") -> tuple:
    """(repetitive, free-form) prompts a run of `split` scores: dev's, or the test set
    named `test_prompts` ("original" / "fresh")."""
    if split == "dev":
        return PROMPTS["dev"]
    if split != "test":
        raise ValueError(f"split must be 'dev' or 'test', got {split!r}")
    if test_prompts not in TEST_PROMPTS:
        raise ValueError(f"test_prompts must be one of {tuple(TEST_PROMPTS)}, "
                         f"got {test_prompts!r}")
    return TEST_PROMPTS[test_prompts]
