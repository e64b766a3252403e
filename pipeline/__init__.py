"""Token-level contrastive BERT pre-training: model, losses, data, DeepSpeed trainer."""
