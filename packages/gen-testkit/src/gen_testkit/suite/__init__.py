"""The conformance suite, one module per concern; ``gen_testkit.conformance`` assembles it."""
