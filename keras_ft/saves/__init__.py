"""How a save is made, one object per job, below `WorkerTrainingState`.

`queue` hands a training's saves to its directory's writer thread (the
process holds each directory's writer: `keras_ft.holdings`); `tiers` is
where a save commits and a restore reads (the backup's store, or a local
tier in front of a bucket); a saver per kind of save: `chief` (copied,
written and committed in the background; every process's own save with a
local tier; a worker's, into the tier of `throwaway`: its temporary
directory, removed right after) and `shards` (a model split across
processes, each writing its share).
"""
