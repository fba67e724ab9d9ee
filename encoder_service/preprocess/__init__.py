"""Media preprocessing (CPU only, no model code): image -> hMLP patches, audio -> dMel codes, video -> sampled
frames (image items) plus its audio track (an audio item). Each modality has a frozen policy whose
`fingerprint()` lists the parameters that change the tower input (they go into the mm_key).

Modules are imported directly (`encoder_service.preprocess.image`, ...), so the image path does not need the
audio libraries."""
