"""Collectives: act on the first rank, agree, settle; one error naming the failing rank."""
