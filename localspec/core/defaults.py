"""Default settings, written once: the API, the CLI flags, `localspec chat`'s /set and the server read them here."""

# llama-cpp-python's sampling defaults (Llama.create_completion), so results compare like for like.
SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
            "frequency_penalty": 0.0, "presence_penalty": 0.0, "penalty_last_n": 64}

DRAFTERS = ("auto", "model", "ngram", "hybrid", "none")
RULES = ("rejection", "greedy", "threshold")

# Engine.generate / stream
MAX_TOKENS = 256
DRAFTER = "auto"
ACCEPT = "rejection"
K_AUTO, K_FIXED = 16, 4  # draft tokens per round: auto's upper bound, a fixed drafter's length
# auto's upper bound when the request carries a prediction: aligned with it, whole lines are accepted at once,
# and one 33-token verify costs about 1.5 of a 17-token one on these CPUs (replayed on 4 edit prompts and the
# amd2 cost curve: 2.13x plain instead of 1.74x with 16)
K_PREDICTION = 32
P_MIN = 0.75             # the draft model stops when its top probability falls below this
THRESHOLD = 0.5          # the lossy threshold rule's tau
