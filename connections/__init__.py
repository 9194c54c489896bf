"""Brokered credentials: organisations' connections to git hosts, APIs and registries, agents'
grants over them, and what the gateway needs to serve them so that no credential ever enters a
sandbox (docs/credentials.md). What is here so far is the part without Django: git's smart HTTP
as the gateway reads it (:mod:`connections.smarthttp`), the commits of a pushed pack
(:mod:`connections.packs`) and the rules of a grant (:mod:`connections.rules`)."""
