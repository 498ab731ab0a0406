"""The invariant suite, once per tiny model: every family's data file and the extra variants
(``kvprobe.models.tiny.tiny_names``), so a new family YAML is tested without editing this file."""

from kvprobe.models import tiny_names
from tests.families.suite import EditSuite, FamilySuite, ProbeSuite

for _name in tiny_names():
    _cls = f"Test_{_name.replace('-', '_')}"
    globals()[_cls] = type(_cls, (FamilySuite, EditSuite, ProbeSuite), {"name": _name})
