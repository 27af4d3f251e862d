"""The load test's scenarios: each a Locust task of its own name and weight (kept apart from the
locustfile, which imports Locust and with it gevent's monkey-patching)."""

# scenario (the name in Locust's statistics) -> weight
WEIGHTS = {"short greedy": 10, "long beam 4": 3, "attention beam 4 n-best 2": 3, "many texts": 2, "list models": 1}
MANY_TEXTS = 16  # texts in one "many texts" request
LONG_JOIN = 3  # texts of the split joined into one "long" sentence
