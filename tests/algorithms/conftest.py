"""Fixtures of the algorithm tests: one client of each reference network (the builders are in ``tests/helpers/``)."""

from tests.helpers.digits_mlp import digits_mlp_setup  # noqa: F401
from tests.helpers.functional_mlp import double_mlp_setup  # noqa: F401
from tests.helpers.split_models import client  # noqa: F401
