{{/*
Rules between values, which values.schema.json cannot express. Each failure names the value,
what it was set to, and what is allowed, like meshserve's own ConfigError.
*/}}
{{- define "meshserve.validate" -}}
{{- $v := .Values -}}
{{- $tp := int $v.engine.tp -}}
{{- $dcp := int $v.engine.dcp -}}
{{- $gpus := int $v.worker.gpus -}}
{{- $divisors := list -}}
{{- range $d := untilStep 1 (int (add $tp 1)) 1 -}}
{{- if eq (mod $tp $d) 0 -}}{{- $divisors = append $divisors $d -}}{{- end -}}
{{- end -}}
{{- if ne (mod $tp $dcp) 0 -}}
{{- fail (printf "engine.dcp=%d is not allowed: it must divide engine.tp=%d (one of %s)" $dcp $tp (join ", " $divisors)) -}}
{{- end -}}
{{- $ep := int (default 1 $v.engine.ep) -}}
{{- if ne (mod $tp $ep) 0 -}}
{{- fail (printf "engine.ep=%d is not allowed: it must divide engine.tp=%d (one of %s)" $ep $tp (join ", " $divisors)) -}}
{{- end -}}
{{- if and (gt $gpus 0) (ne (mod $gpus $tp) 0) -}}
{{- fail (printf "engine.tp=%d is not allowed with worker.gpus=%d: a tensor-parallel group must fit in one worker pod, so tp must divide worker.gpus (raise worker.gpus to a multiple of %d, or lower tp)" $tp $gpus $tp) -}}
{{- end -}}
{{- if eq $v.pools.mode "disaggregated" -}}
{{- range $pool := list "prefill" "decode" -}}
{{- $ptp := int (include "meshserve.poolTp" (dict "root" $ "pool" $pool)) -}}
{{- $pdcp := int (include "meshserve.poolDcp" (dict "root" $ "pool" $pool)) -}}
{{- $pdiv := list -}}
{{- range $d := untilStep 1 (int (add $ptp 1)) 1 -}}
{{- if eq (mod $ptp $d) 0 -}}{{- $pdiv = append $pdiv $d -}}{{- end -}}
{{- end -}}
{{- if ne (mod $ptp $pdcp) 0 -}}
{{- fail (printf "pools.%s.dcp=%d is not allowed: it must divide the pool's tp=%d (one of %s)" $pool $pdcp $ptp (join ", " $pdiv)) -}}
{{- end -}}
{{- if and (gt $gpus 0) (ne (mod $gpus $ptp) 0) -}}
{{- fail (printf "pools.%s.tp=%d is not allowed with worker.gpus=%d: a tensor-parallel group must fit in one worker pod, so tp must divide worker.gpus" $pool $ptp $gpus) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (eq $gpus 0) (contains "FLASHINFER" (toString $v.engine.attentionBackend)) -}}
{{- fail (printf "engine.attentionBackend=%s is not allowed with worker.gpus=0: FlashInfer needs CUDA GPUs (use auto, TORCH or TRITON)" $v.engine.attentionBackend) -}}
{{- end -}}
{{- if and $v.tls.existingSecret (eq $v.probes.mode "grpc") -}}
{{- fail (printf "probes.mode=grpc is not allowed with tls.existingSecret=%s: the kubelet's gRPC probe cannot speak TLS (use auto or exec)" $v.tls.existingSecret) -}}
{{- end -}}
{{- if and $v.model.path $v.model.pvc.claimName (not (hasPrefix (printf "%s/" (trimSuffix "/" $v.model.pvc.mountPath)) (printf "%s/" $v.model.path))) -}}
{{- fail (printf "model.path=%s is not allowed with model.pvc.claimName=%s: the path must lie under model.pvc.mountPath=%s" $v.model.path $v.model.pvc.claimName $v.model.pvc.mountPath) -}}
{{- end -}}
{{- $ports := dict -}}
{{- range $name, $port := dict "service.grpcPort" $v.service.grpcPort "service.metricsPort" $v.service.metricsPort "ray.port" $v.ray.port "ray.nodeManagerPort" $v.ray.nodeManagerPort "ray.objectManagerPort" $v.ray.objectManagerPort -}}
{{- $key := toString (int $port) -}}
{{- if hasKey $ports $key -}}
{{- fail (printf "%s=%s is not allowed: %s already uses that port (each port must differ)" $name $key (get $ports $key)) -}}
{{- end -}}
{{- $_ := set $ports $key $name -}}
{{- end -}}
{{- end -}}
