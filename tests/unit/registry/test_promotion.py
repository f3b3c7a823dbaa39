"""The promotion record of a version (`promotion.record_tags`): one JSON value that later events extend
(who replaced or rolled back the version) without losing what the promotion recorded, beside the status."""

from __future__ import annotations

import json
import types

from chunkgrpo.registry.promotion import readable_decision, record_tags


class _Client:
    def __init__(self, tags):
        self.tags = tags

    def get_model_version(self, name, version):
        return types.SimpleNamespace(name=name, version=version, tags=dict(self.tags))


def test_record_is_merged_over_the_versions_own():
    first = record_tags(_Client({}), "m", "2", "champion", by="ann", why="better", gate={"candidate": 0.4})
    assert first["promotion.status"] == "champion"
    later = record_tags(_Client(first), "m", "2", "previous", replaced_by="3", replaced_at="t")
    record = json.loads(later["promotion.record"])
    assert later["promotion.status"] == "previous"
    assert record == {"by": "ann", "why": "better", "gate": {"candidate": 0.4}, "replaced_by": "3",
                      "replaced_at": "t"}


def test_an_unreadable_record_is_replaced_not_fatal():
    out = record_tags(_Client({"promotion.record": "{not json"}), "m", "1", "rolled_back", rollback_why="x")
    assert json.loads(out["promotion.record"]) == {"rollback_why": "x"}
    assert readable_decision("rejected", "too low") == {"gate.decision": "rejected", "gate.reason": "too low"}
