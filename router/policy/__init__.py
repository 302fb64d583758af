"""The routing stage: filters narrow the replicas, scorers rate the rest, a picker chooses.

Every filter, scorer and picker is a small class registered by name; a policy is an ordered list
of filters, weighted scorers and a picker, built from the configuration (``policy:`` a preset
name, or ``{filters, scorers, picker}``). The score of a replica is ``sum(weight x scorer)``
with every scorer in [0, 1]. They all read a request (:class:`~router.request.RouteRequest`) and
immutable replica views (:class:`~router.view.ReplicaView`), never live objects.

Adding a scorer is one class and one registration::

    @register_scorer("fewest-waiting")
    class FewestWaiting(Scorer):
        def __call__(self, req, view):
            return 1.0 / (1.0 + view.external_load)

A plug-in outside this package is named ``module:Class`` in the configuration. A stage with
parameters declares them as a pydantic model ``Params``; the configuration entry's other keys
are validated against it and the stage is built as ``Class(params)``.
"""

from __future__ import annotations

# importing each stage module registers its stages
from . import predict
from .build import build_policy
from .cost import CostTerms, PredictedTTFTScorer
from .decision import Policy
from .filters import DEFAULT_FILTERS, BelowCapacity, MeetsSlo, NotDrained, NotTried, Ready, Role, ServesModel, TransferPair
from .pickers import MaxScoreParams, MaxScorePicker, RoundRobinPicker
from .scorers import KVUsageScorer, LoadScorer, PrefixScorer, SessionScorer
from .stages import (FILTERS, PICKERS, SCORERS, Empty, Filter, NoCandidate, Picker, Scored, Scorer, Stage,
                     register_filter, register_picker, register_scorer)

__all__ = ["BelowCapacity", "CostTerms", "DEFAULT_FILTERS", "Empty", "FILTERS", "Filter", "KVUsageScorer",
           "LoadScorer", "MaxScoreParams", "MeetsSlo", "MaxScorePicker", "NoCandidate", "NotDrained", "NotTried", "PICKERS", "Picker", "Policy",
           "PredictedTTFTScorer", "PrefixScorer", "Ready", "Role", "RoundRobinPicker", "SCORERS", "Scored", "Scorer",
           "ServesModel", "SessionScorer", "Stage", "TransferPair", "build_policy", "predict", "register_filter",
           "register_picker", "register_scorer"]
