"""After the audit: the op drill-down, the census, the fix verification, and the knowledge
table of known-nondeterministic ops they cite."""
