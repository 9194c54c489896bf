"""Brokered credentials: organisations' connections to git hosts, APIs and registries
(:mod:`connections.models`, changed through :mod:`connections.services`), agents' grants over
them (:mod:`connections.grants`; the grants are a field of the agent, versioned with it), and
what the gateway needs to serve them so that no credential ever enters a sandbox
(docs/credentials.md). Without Django: the gateway's git route (:mod:`connections.broker`),
git's smart HTTP as it reads it (:mod:`connections.smarthttp`), the commits of a pushed pack
(:mod:`connections.packs`) and the rules of a grant (:mod:`connections.rules`)."""
