{{/*
Names and labels. Every object name is a DNS label of at most 63 characters: the base name is
cut to 45 so that the longest suffix ("-worker-prefill") still fits.
*/}}
{{- define "meshserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "meshserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of the headless Service workers use to reach the Ray head (GCS). */}}
{{- define "meshserve.rayHeadService" -}}
{{- printf "%s-ray" (include "meshserve.fullname" .) -}}
{{- end -}}

{{- define "meshserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "meshserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "meshserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "meshserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "meshserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: meshserve
{{- end -}}

{{/* Pod labels of the head: selector labels plus the component. */}}
{{- define "meshserve.headSelectorLabels" -}}
{{ include "meshserve.selectorLabels" . }}
app.kubernetes.io/component: head
{{- end -}}

{{/* Pod labels of one worker pool; call with (dict "root" $ "pool" "prefill"). */}}
{{- define "meshserve.workerSelectorLabels" -}}
{{ include "meshserve.selectorLabels" .root }}
app.kubernetes.io/component: worker
meshserve.io/pool: {{ .pool }}
{{- end -}}

{{- define "meshserve.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The pools this release runs, as a list. */}}
{{- define "meshserve.pools" -}}
{{- if eq .Values.pools.mode "unified" -}}
["unified"]
{{- else -}}
["prefill", "decode"]
{{- end -}}
{{- end -}}

{{/*
A pool's layout: pools.<pool>.tp / .dcp when set (prefill and decode pools), else engine.tp /
engine.dcp. Call with (dict "root" $ "pool" NAME).
*/}}
{{- define "meshserve.poolTp" -}}
{{- $p := get .root.Values.pools .pool -}}
{{- if or (not (hasKey $p "tp")) (kindIs "invalid" (get $p "tp")) -}}
{{- int .root.Values.engine.tp -}}
{{- else -}}
{{- int (get $p "tp") -}}
{{- end -}}
{{- end -}}
{{- define "meshserve.poolDcp" -}}
{{- $p := get .root.Values.pools .pool -}}
{{- if or (not (hasKey $p "dcp")) (kindIs "invalid" (get $p "dcp")) -}}
{{- int .root.Values.engine.dcp -}}
{{- else -}}
{{- int (get $p "dcp") -}}
{{- end -}}
{{- end -}}

{{/*
Ranks one worker pod of a pool hosts: its GPUs, or one whole replica (the pool's tp ranks) on
CPU-only pods. Each pod advertises this many units of the Ray resource "meshserve_<pool>".
Call with (dict "root" $ "pool" NAME).
*/}}
{{- define "meshserve.slotsPerPod" -}}
{{- if gt (int .root.Values.worker.gpus) 0 -}}
{{- int .root.Values.worker.gpus -}}
{{- else -}}
{{- include "meshserve.poolTp" . -}}
{{- end -}}
{{- end -}}

{{/* Worker pods of one pool: ceil(replicas * tp / slots). Call with (dict "root" $ "pool" NAME). */}}
{{- define "meshserve.workerPods" -}}
{{- $v := .root.Values -}}
{{- $replicas := int (get (get $v.pools .pool) "replicas") -}}
{{- $ranks := mul $replicas (int (include "meshserve.poolTp" .)) -}}
{{- $slots := int (include "meshserve.slotsPerPod" .) -}}
{{- div (add $ranks (sub $slots 1)) $slots -}}
{{- end -}}

{{/* The model directory `meshserve serve --model` gets; empty means the bundled demo model. */}}
{{- define "meshserve.modelPath" -}}
{{- if .Values.model.path -}}
{{- .Values.model.path -}}
{{- else if .Values.model.pvc.claimName -}}
{{- .Values.model.pvc.mountPath -}}
{{- end -}}
{{- end -}}

{{- define "meshserve.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "meshserve.fullname" .) .Release.Namespace) .Values.tls.serverName -}}
{{- end -}}

{{/* Native gRPC probes unless TLS is on (the kubelet's gRPC probe speaks plaintext only). */}}
{{- define "meshserve.probeMode" -}}
{{- if eq .Values.probes.mode "auto" -}}
{{- ternary "exec" "grpc" (ne .Values.tls.existingSecret "") -}}
{{- else -}}
{{- .Values.probes.mode -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the Ray cluster token: the existing one, the chart's own, or "" (auth off). */}}
{{- define "meshserve.rayTokenSecret" -}}
{{- if .Values.ray.authToken.existingSecret -}}
{{ .Values.ray.authToken.existingSecret }}
{{- else if .Values.ray.authToken.create -}}
{{ include "meshserve.fullname" . }}-ray-token
{{- end -}}
{{- end -}}
