"""Scan bodies with plain ``assert`` statements, for test_errors.py.

They live outside the test modules because pytest rewrites the asserts of those (into
code with side effects of its own, which Dynamo reports differently): a user's body
keeps Python's own ``assert``, and these do too.
"""


def asserts_a_shape(c, x):  # Dynamo finds the condition False while tracing
    assert c.shape[0] == 5, "need 5"
    return c + x, c


def asserts_after_an_op(c, x):  # the same with a node in the subgraph already
    c = c * 2
    assert c.shape[0] == 5, "need 5"
    return c + x, c
