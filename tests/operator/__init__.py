"""Tests of the kelastic operator: CRD, reconcile, pod builder, kopf handlers."""
