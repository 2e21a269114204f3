"""How a checkpoint reaches storage and how a reader knows it can trust one.

`store` is the commit protocol (staging, manifest, rename, verify, retention);
`files` writes and checksums a file's bytes; `lock` keeps one writer per
directory. Nothing here knows Keras.
"""
